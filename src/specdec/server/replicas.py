"""`specdec serve --replicas N | --autoscale MIN:MAX | --address ADDR`: the same API as a Ray
Serve application, one process per replica.

Three deployments make the application:

- `SpecdecReplica` (N of them, or MIN..MAX with autoscaling): each is one process holding its
  own decoder and the FastAPI app of `create_app`, hence its own scheduler thread and its own
  continuous batching. Requests reach the app through `handle_http`, which runs the ASGI app
  in the replica and streams its ASGI messages back.
- `SpecdecGateway`, the HTTP ingress behind Ray's proxy: it reads the request, hands it to a
  replica (Ray picks the less loaded of two) and relays the replica's messages. When the
  replica dies before answering, the request goes once more to another replica; when it
  dies in the middle of a stream, the stream ends as the one-process server ends a stream
  that fails: an OpenAI-shaped `data: {"error": ...}` event, then `data: [DONE]`.
- `SpecdecHub`: every replica sends it its Prometheus samples every couple of seconds, so
  that /metrics, answered by any replica, shows all of them, each sample with a `replica`
  label (and `specdec_replica_info{replica, node, pid}`). It also tells every replica when
  `specdec serve` stops: each then ends its streams with an error event and [DONE] and its
  queued requests with a 503, as the one-process server does on SIGTERM.

Every response carries the header `X-Specdec-Replica` naming the replica that answered.

Only `specdec serve` with one of those flags imports this module, and Ray only once it runs:
plain `specdec serve` is one process and never imports ray.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncGenerator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import SpecdecError
from specdec.server.app import ServerConfig
from specdec.server.errors import error_body

log = logging.getLogger("specdec.server")

APP_NAME = "specdec"
REPLICA_HEADER = b"x-specdec-replica"
PUSH_INTERVAL_S = 2.0  # how often a replica sends its metrics to the hub
STALE_AFTER_S = 10.0  # a replica not heard from for this long is left out of /metrics
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string",
               "root_path", "client", "server")


@dataclass
class ReplicaSpec:
    """What every replica loads and serves: `specdec.load`'s arguments (dtype by name, so that
    "auto" is decided on the replica's own node), the model name and the server's limits."""

    load: dict[str, Any]
    model_name: str = "specdec"
    config: ServerConfig = field(default_factory=ServerConfig)
    threads: int = 1  # torch threads per replica


@dataclass
class Scale:
    replicas: int | None = None  # a fixed count
    autoscale: tuple[int, int] | None = None  # MIN, MAX


def parse_scale(replicas: int | None, autoscale: str | None) -> Scale:
    """The replica count from --replicas / --autoscale (one line of error otherwise)."""
    if replicas is not None and autoscale is not None:
        raise SpecdecError("give --replicas N or --autoscale MIN:MAX, not both")
    if replicas is not None:
        if replicas < 1:
            raise SpecdecError(f"--replicas must be at least 1 (got {replicas})")
        return Scale(replicas=replicas)
    if autoscale is not None:
        lo, sep, hi = autoscale.partition(":")
        try:
            pair = (int(lo), int(hi)) if sep else None
        except ValueError:
            pair = None
        if pair is None or pair[0] < 1 or pair[1] < pair[0]:
            raise SpecdecError(f"--autoscale must be MIN:MAX with 1 <= MIN <= MAX, such as 1:4 (got '{autoscale}')")
        return Scale(autoscale=pair)
    return Scale(replicas=1)


# --------------------------------------------------------------------------------- replicas
class SpecdecReplica:
    """One replica: a decoder, `create_app`'s app (its scheduler thread starts with the app's
    lifespan, here) and a task that sends the app's metrics to the hub."""

    async def __init__(self, spec: ReplicaSpec, hub: Any) -> None:  # type: ignore[misc]  # Ray awaits it
        import torch
        from ray import serve

        from specdec.api import load
        from specdec.heap import one_heap
        from specdec.server.app import create_app
        from specdec.wiring import resolve_dtype

        torch.set_num_threads(max(1, spec.threads))
        one_heap()  # threads made from here on (the model's) share one heap, as `specdec serve`'s do
        self.name = serve.get_replica_context().replica_id.unique_id
        self.node = socket.gethostname()
        self.hub = hub
        kwargs = {**spec.load, "dtype": resolve_dtype(spec.load.get("dtype") or "default")}
        decoder = await asyncio.to_thread(load, **kwargs)
        self.app = create_app(decoder, spec.model_name, spec.config)
        self._replace_metrics_route()
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # the warm-up, then the scheduler serves
        self._tasks: set[asyncio.Task[None]] = set()
        self._keep(self._push_loop())
        self._keep(self._await_stop())
        log.info("replica %s ready (pid %d on %s)", self.name, os.getpid(), self.node)

    def _keep(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---------------------------------------------------------------- HTTP, relayed
    async def handle_http(self, scope: dict[str, Any], body: bytes) -> AsyncGenerator[list[dict[str, Any]], None]:
        """Run the app on one request; yield its ASGI messages, in batches of what is ready.
        When the caller goes away (the client disconnected, the gateway cancelled), the app
        sees an http.disconnect, as under uvicorn, and cancels the request."""
        out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False
        name = self.name.encode()

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            message = dict(message)
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (REPLICA_HEADER, name)]
            out.put_nowait(message)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            except Exception:  # the app's own handlers answer errors; this is what escaped them
                log.exception("replica %s: the app failed on %s", self.name, scope.get("path"))
            finally:
                out.put_nowait(None)

        task = asyncio.get_running_loop().create_task(run())
        try:
            while True:
                batch = [await out.get()]
                while not out.empty():
                    batch.append(out.get_nowait())
                messages = [m for m in batch if m is not None]
                if messages:
                    yield messages
                if None in batch:
                    return
        finally:
            if not task.done():
                gone.set()
                self._keep(_reap(task))

    # ---------------------------------------------------------------- metrics
    def _families(self) -> list[Any]:
        from prometheus_client.core import GaugeMetricFamily

        info = GaugeMetricFamily("specdec_replica_info", "This replica's node and process", labels=["node", "pid"])
        info.add_metric([self.node, str(os.getpid())], 1.0)
        return [*self.app.state.metrics.registry.collect(), info]

    async def _push_loop(self) -> None:
        while True:
            try:
                await self.hub.push.remote(self.name, self._families())
            except Exception as e:  # the hub is being replaced: the next push reaches the new one
                log.debug("replica %s: metrics push failed: %s", self.name, e)
            await asyncio.sleep(PUSH_INTERVAL_S)

    async def _await_stop(self) -> None:
        while True:
            try:
                if await self.hub.wait_stop.remote():
                    log.info("replica %s: stopping", self.name)
                    self.app.state.scheduler.shut_down()
                    return
            except Exception:  # the hub is being replaced
                await asyncio.sleep(PUSH_INTERVAL_S)

    def _replace_metrics_route(self) -> None:
        """/metrics shows every live replica's samples, each with a `replica` label."""
        from fastapi import Response
        from fastapi.routing import APIRoute

        app = self.app
        app.router.routes[:] = [r for r in app.router.routes if not (isinstance(r, APIRoute) and r.path == "/metrics")]

        async def all_replicas() -> Response:
            own = self._families()
            try:
                seen = await asyncio.wait_for(self.hub.push_and_gather.remote(self.name, own), 5.0)
            except Exception as e:  # no hub now: this replica's own samples
                log.warning("replica %s: the metrics hub did not answer (%s)", self.name, e)
                seen = {self.name: own}
            return Response(render_metrics(seen), media_type="text/plain; version=0.0.4; charset=utf-8")

        app.add_api_route("/metrics", all_replicas, methods=["GET"], include_in_schema=False)

    async def __del__(self) -> None:  # after Ray's drain (scale-down, a stop): end what is left, stop the thread
        for task in list(getattr(self, "_tasks", ())):
            task.cancel()
        if hasattr(self, "_lifespan"):
            self.app.state.scheduler.shut_down()
            await self._lifespan.__aexit__(None, None, None)


async def _reap(task: asyncio.Task[None], grace_s: float = 5.0) -> None:
    """Give an abandoned request's app a moment to see its disconnect and end, then cancel it."""
    try:
        await asyncio.wait_for(asyncio.shield(task), grace_s)
    except (TimeoutError, asyncio.CancelledError):
        task.cancel()
    except Exception:
        pass


def render_metrics(per_replica: dict[str, list[Any]]) -> bytes:
    """One exposition of several replicas' metric families, every sample labelled with its replica."""
    from prometheus_client import generate_latest
    from prometheus_client.metrics_core import Metric

    class Merged:
        def collect(self) -> Any:
            merged: dict[str, Metric] = {}
            for replica in sorted(per_replica):
                for fam in per_replica[replica]:
                    into = merged.get(fam.name)
                    if into is None:
                        into = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                    into.samples.extend(s._replace(labels={**s.labels, "replica": replica}) for s in fam.samples)
            yield from merged.values()

    return generate_latest(Merged())  # type: ignore[arg-type]


class SpecdecHub:
    """The replicas' latest samples, by replica (one silent for STALE_AFTER_S is dropped), and
    the word to stop."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[float, list[Any]]] = {}
        self.stopping = asyncio.Event()

    async def wait_stop(self, timeout_s: float = 30.0) -> bool:
        """True once `stop` has been called; False after timeout_s (the caller asks again)."""
        try:
            await asyncio.wait_for(self.stopping.wait(), timeout_s)
        except TimeoutError:
            pass
        return self.stopping.is_set()

    async def stop(self) -> None:
        self.stopping.set()

    async def push(self, replica: str, families: list[Any]) -> None:
        self.seen[replica] = (time.monotonic(), families)

    async def push_and_gather(self, replica: str, families: list[Any]) -> dict[str, list[Any]]:
        await self.push(replica, families)
        now = time.monotonic()
        self.seen = {r: v for r, v in self.seen.items() if now - v[0] < STALE_AFTER_S}
        return {r: v[1] for r, v in self.seen.items()}


# --------------------------------------------------------------------------------- gateway
class SpecdecGateway:
    """The ASGI app of the ingress deployment: one request in, relayed to a replica."""

    def __init__(self, app_name: str, body_limit: int) -> None:
        self.app_name, self.body_limit = app_name, body_limit
        self._replicas: Any = None

    def replicas(self) -> Any:
        if self._replicas is None:
            from ray import serve

            self._replicas = serve.get_deployment_handle("SpecdecReplica", self.app_name)
        return self._replicas.options(stream=True)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            raise RuntimeError(f"specdec serves HTTP only, not {scope['type']}")
        body = await self._body(receive)
        if body is None:
            return
        inner = {k: scope[k] for k in _SCOPE_KEYS if k in scope}
        inner["headers"] = [(bytes(k), bytes(v)) for k, v in scope["headers"]]
        for attempt in (1, 2):
            started = finished = events = False
            failure: BaseException | None = None
            stream = self.replicas().handle_http.remote(inner, body)
            try:
                async for batch in stream:
                    for message in batch:
                        if message["type"] == "http.response.start":
                            started = True
                            events = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                         for k, v in message.get("headers", []))
                        elif message["type"] == "http.response.body" and not message.get("more_body", False):
                            finished = True
                        await send(message)
                if finished:
                    return
            except asyncio.CancelledError:  # the client went away: so does the replica's request
                stream.cancel()
                raise
            except Exception as e:
                failure = e
            if not started and attempt == 1 and _replica_gone(failure):
                log.warning("a replica stopped before answering %s (%s): trying another", scope.get("path"),
                            _describe(failure))
                continue
            break
        why = _describe(failure) if failure is not None else "it ended the response early"
        log.warning("the replica serving %s stopped: %s", scope.get("path"), why)
        if not started:
            payload = json.dumps(error_body(503, f"the replica serving this request stopped ({why}); retry",
                                            None, "replica_unavailable")).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode()), (b"retry-after", b"1")]})
            await send({"type": "http.response.body", "body": payload, "more_body": False})
        elif events:  # a stream: an error event, then [DONE], as streams end
            err = error_body(500, f"the replica serving this stream stopped ({why})", None, "replica_failed")
            chunk = f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": chunk, "more_body": False})
        else:  # a body cut short cannot be mended: the connection is closed
            raise RuntimeError(f"the replica stopped in the middle of a response: {why}")

    async def _body(self, receive: Any) -> bytes | None:
        """The request body, or its first body_limit + 1 bytes (the replica's app answers 413,
        after the API key check, as the one-process server does). None: the client left."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            if size <= self.body_limit:
                chunks.append(chunk[:self.body_limit + 1 - size])
            size += len(chunk)
            more = bool(message.get("more_body", False))
        return b"".join(chunks)


def _replica_gone(e: BaseException | None) -> bool:
    from ray.exceptions import ActorUnavailableError, RayActorError

    return isinstance(e, RayActorError | ActorUnavailableError)


def _describe(e: BaseException | None) -> str:
    if e is None:
        return "unknown"
    from ray.exceptions import RayActorError

    if isinstance(e, RayActorError):
        return "its process died"
    return type(e).__name__


def _gateway_builder(app_name: str, body_limit: int) -> Any:
    def build() -> SpecdecGateway:
        return SpecdecGateway(app_name, body_limit)

    return build


# --------------------------------------------------------------------------------- the application
def application(spec: ReplicaSpec, scale: Scale, cpus_per_replica: float = 1.0, gpus_per_replica: float = 0.0,
                shutdown_timeout_s: float = 3.0, app_name: str = APP_NAME) -> Any:
    """The bound Serve application: gateway -> replicas (+ the metrics hub)."""
    from ray import serve

    config = spec.config
    ongoing = config.max_batch + config.max_queue + 8  # beyond batch + queue the app itself answers 429
    # A replica that Ray removes (scale-down) first finishes its requests, for up to a request's
    # deadline; on SIGTERM `stop_replicas` has ended them all before.
    drain_s = max(shutdown_timeout_s, min(config.timeout_s or 600.0, 600.0))
    options: dict[str, Any] = dict(
        max_ongoing_requests=ongoing,
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
        graceful_shutdown_timeout_s=drain_s, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=2.0, health_check_timeout_s=30.0,
    )
    if scale.autoscale is not None:
        lo, hi = scale.autoscale
        options["autoscaling_config"] = {"min_replicas": lo, "max_replicas": hi, "initial_replicas": lo,
                                         "target_ongoing_requests": max(1, config.max_batch)}
        most = hi
    else:
        options["num_replicas"] = scale.replicas
        most = scale.replicas or 1
    replica = serve.deployment(name="SpecdecReplica", **options)(SpecdecReplica)
    hub = serve.deployment(name="SpecdecHub", num_replicas=1, max_ongoing_requests=4 * most + 64,
                           ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=1.0)(SpecdecHub)
    gateway_cls = serve.ingress(_gateway_builder(app_name, config.max_body_bytes))()
    gateway = serve.deployment(name="SpecdecGateway", num_replicas=1, max_ongoing_requests=ongoing * most + 64,
                               ray_actor_options={"num_cpus": 0},  # it outlives the replicas' own stop
                               graceful_shutdown_timeout_s=shutdown_timeout_s + 5.0,
                               graceful_shutdown_wait_loop_s=0.5)(gateway_cls)
    return gateway.bind(replica.bind(spec, hub.bind()))


def run_replicas(spec: ReplicaSpec, scale: Scale, *, address: str | None, host: str, port: int,
                 cpus_per_replica: float, gpus_per_replica: float, shutdown_timeout_s: float) -> int:
    """`specdec serve` on Ray Serve, until SIGINT or SIGTERM. On either, every replica ends
    its streams (an error event, then [DONE]) and its queued requests (503) at once, then the
    application is deleted: the whole of Serve and the Ray processes when the cluster was
    started here, only this application on a cluster given by --address."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SpecdecError("--replicas, --autoscale and --address need Ray Serve: pip install 'specdec[ray]' "
                           "(scripts/setup installs it)") from None
    local = address is None and not os.environ.get("RAY_ADDRESS")
    count = scale.autoscale[1] if scale.autoscale else (scale.replicas or 1)
    init: dict[str, Any] = dict(logging_level=logging.WARNING)
    if local:  # a one-node cluster of this machine, with room for the replicas that were asked for
        # Every Ray process of a local cluster (agents included) on loopback, not the host's address
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        init.update(include_dashboard=False, num_cpus=max(os.cpu_count() or 1, math.ceil(count * cpus_per_replica)),
                    _node_ip_address="127.0.0.1")  # a local cluster talks over loopback only
    # The Ray processes started here inherit an ignored SIGINT, so that Ctrl-C in a terminal
    # (sent to the whole process group) stops this process, which then stops them in order.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ray.init(address=address, **init)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise SpecdecError(f"cannot start or join the Ray cluster: {str(e).strip().splitlines()[0]}") from None
    finally:
        signal.signal(signal.SIGINT, previous)
    stop, started = threading.Event(), False

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()
        if not started:  # still deploying: give up at once
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        quiet = {"log_level": "WARNING", "enable_access_log": False}  # no line per request, nor per metrics push
        serve.start(http_options={"host": host, "port": port}, logging_config=quiet)
        try:
            serve.run(application(spec, scale, cpus_per_replica, gpus_per_replica, shutdown_timeout_s),
                      name=APP_NAME, route_prefix="/", logging_config=quiet)
        except RuntimeError as e:  # a replica's constructor failed (Ray tried it a few times)
            raise SpecdecError(f"the replicas could not start: {_deploy_failure(serve, e)}") from None
        started = True
        how = f"{scale.replicas} replica(s)" if scale.replicas else \
            f"{scale.autoscale[0]} to {scale.autoscale[1]} replicas (autoscaled)" if scale.autoscale else ""
        log.info("specdec: serving %s on Ray Serve at http://%s:%d (Ctrl-C stops)", how, host, port)
        while not stop.wait(0.5):
            pass
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        log.info("specdec: stopping the replicas")
        try:
            if started:
                stop_replicas(APP_NAME)
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()


def _deploy_failure(serve: Any, e: Exception) -> str:
    """The line of a failed deployment's message that says why (a specdec error if any)."""
    try:
        message = serve.status().applications[APP_NAME].deployments["SpecdecReplica"].message
    except Exception:
        message = ""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    ours = [line.split(": ", 1)[1] for line in lines if line.startswith("specdec.") and ": " in line]
    return (ours or lines or [str(e).strip().splitlines()[0]])[-1]


def stop_replicas(app_name: str = APP_NAME, settle_s: float = 1.0) -> None:
    """Tell every replica to end its requests now (as one process does on SIGTERM), and give
    the ends a moment to reach the clients."""
    from ray import serve

    try:
        serve.get_deployment_handle("SpecdecHub", app_name).stop.remote().result(timeout_s=10)
        time.sleep(settle_s)
    except Exception as e:
        log.warning("specdec: could not tell the replicas to stop (%s)", e)
