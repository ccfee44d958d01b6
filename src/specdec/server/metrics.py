"""Prometheus metrics, in a registry of their own per app (several apps may live in one
process, as in the tests). The scheduler thread updates them; /metrics renders them."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdec.events import RoundEvent
from specdec.prefix import PrefixCache

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("specdec_requests", "Requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.rejected = Counter("specdec_rejected", "Requests refused before queueing, by reason", ["reason"],
                                registry=r)
        self.disconnects = Counter("specdec_disconnects", "Clients that went away before their answer ended",
                                   ["stage"], registry=r)
        self.queue_depth = Gauge("specdec_queue_depth", "Requests waiting for a slot", registry=r)
        self.batch_size = Gauge("specdec_batch_size", "Requests being generated now", registry=r)
        self.step_rows = Histogram("specdec_step_batch_size", "Requests in each engine step (1 when not batched)",
                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.rounds = Counter("specdec_rounds", "Speculation rounds", registry=r)
        self.drafted = Counter("specdec_drafted_tokens", "Tokens proposed by the prophet", registry=r)
        self.accepted = Counter("specdec_accepted_tokens", "Drafted tokens the target accepted", registry=r)
        self.recovered = Counter("specdec_recovered_tokens", "Tokens resampled after a rejection", registry=r)
        self.bonus = Counter("specdec_bonus_tokens", "Tokens sampled after a fully accepted draft", registry=r)
        self.generated = Counter("specdec_generated_tokens", "Tokens committed to outputs", registry=r)
        self.acceptance = Gauge("specdec_acceptance_rate", "Accepted / drafted tokens since start", registry=r)
        self.tokens_per_round = Histogram("specdec_tokens_per_round", "Tokens committed per round",
                                          buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32), registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "From arrival to the first committed token",
                              buckets=_SECONDS, registry=r)
        self.latency = Histogram("specdec_request_latency_seconds", "From arrival to the last token",
                                 buckets=_SECONDS, registry=r)
        self.queue_wait = Histogram("specdec_queue_wait_seconds", "From arrival to the first round",
                                    buckets=_SECONDS, registry=r)
        self.prefix_hits = Counter("specdec_prefix_cache_hit_tokens", "Prompt positions read from the prefix cache "
                                   "instead of computed (--prefix-cache)", registry=r)
        self.prefix_bytes = Gauge("specdec_prefix_cache_bytes", "Bytes of prompt prefixes' keys and values kept",
                                  registry=r)
        self._lock = threading.Lock()
        self._drafted = self._accepted = 0
        self._prefix_seen = 0

    def prefix(self, cache: PrefixCache | None) -> None:
        """After a step: what the engine's prefix cache saved and holds."""
        if cache is None:
            return
        self.prefix_hits.inc(max(0, cache.stats.hit_tokens - self._prefix_seen))
        self._prefix_seen = cache.stats.hit_tokens
        self.prefix_bytes.set(cache.nbytes)

    def round(self, event: RoundEvent) -> None:
        drafted, accepted = len(event.drafted), event.accepted_out  # only tokens that reached the output
        self.rounds.inc()
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        self.generated.inc(len(event.committed))
        self.tokens_per_round.observe(len(event.committed))
        kind = event.closing_kind
        if kind == "recovered":
            self.recovered.inc()
        elif kind == "bonus":
            self.bonus.inc()
        with self._lock:
            self._drafted += drafted
            self._accepted += accepted
            if self._drafted:
                self.acceptance.set(self._accepted / self._drafted)

    def text(self) -> bytes:
        return generate_latest(self.registry)
