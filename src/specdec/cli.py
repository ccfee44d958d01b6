"""The `specdec` command line: generate, check, train, distill, index, bench, serve."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

from specdec.defaults import (
    KV_DTYPES,
    MAX_NEW_TOKENS,
    PREFILL_CHUNK,
    SAMPLING_RULE,
    SERVE_PREFIX_CACHE_MB,
    TEMPERATURE,
    TOP_P,
)
from specdec.errors import SpecdecError


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="target model: smollm2 (the default: SmolLM2-135M-Instruct), bundled (the small pair "
                        "trained here on the standard library, for tests and quick runs), a Hugging Face id, a "
                        "local directory or a GGUF file")
    p.add_argument("--draft", default="default",
                   help="prophet(s): a model id/path, ngram, retrieval, layerskip:L, none, or several joined "
                        "with '+' (default: the target's shipped prophets: for smollm2 prompt lookup, then its "
                        "eagle prophet; for bundled its prophet; for other models prompt lookup and the suffix "
                        "index over the request's own context, ngram+retrieval:context with --multi best)")
    p.add_argument("--policy", default="auto", choices=["auto", "fixed", "adaptive", "confidence", "optimal"],
                   help="draft-length policy (auto: K while speculation pays, plain steps while it does not)")
    p.add_argument("--multi", default="auto", choices=["auto", "tree", "best", "first"],
                   help="several prophets: verify a token tree of all drafts (tree), the first that proposes "
                        "something in order of recent tokens per round, untried first (best), or the first in "
                        "--draft order that proposes something (first); auto: "
                        "first when a feature prophet is among them, else tree")
    p.add_argument("--branches", type=int, default=1, metavar="N",
                   help="1 (default): prophets draft chains; N > 1: an eagle prophet grows a token tree each round, "
                        "up to N children a node, each kept while it pays by the measured step costs (EAGLE-2's "
                        "dynamic trees; exact at every temperature)")
    p.add_argument("--retrieval-index", default=None, help="datastore for --draft retrieval (default: built once)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow model code from the model's repository")
    p.add_argument("--dtype", default="default", choices=["default", "float32", "bfloat16", "auto", "int4"],
                   help="the target's weights (default: int4 for a GGUF target such as smollm2 on the CPU, float32 "
                        "for other models; auto: bfloat16 where the CPU computes it natively; int4: 4-bit "
                        "weights multiplied natively on the CPU, a GGUF file's own Q4_1 blocks such as smollm2's, "
                        "lean path only). Greedy output equals plain decoding's in each on the lean path (Llama "
                        "models); with the transformers backend in bfloat16, a pass over K+1 tokens rounds "
                        "differently from K+1 single steps, so it can differ where two logits nearly tie")
    p.add_argument("--kv-dtype", default=None, choices=list(KV_DTYPES),
                   help="what the KV cache holds (default: $SPECDEC_KV_DTYPE, else auto: float16 for a 4-bit "
                        "target on the CPU, as llama.cpp keeps its cache, the model's dtype otherwise); reads "
                        "convert float16 exactly, so greedy output still equals plain decoding's")
    p.add_argument("--device", default="cpu",
                   help="cpu (default), cuda, cuda:N, mps or auto (a GPU when there is one, else the CPU)")
    p.add_argument("--backend", default="auto", choices=["auto", "hf", "fast"],
                   help="auto: specdec's lean path for plain Llama models, else transformers; hf: always transformers")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=TEMPERATURE,
                   help=f"0 = greedy (default {TEMPERATURE:g}; {SAMPLING_RULE})")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default: all)")
    p.add_argument("--top-p", type=float, default=TOP_P, help=f"nucleus sampling (default {TOP_P:g})")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--draft-tokens", "-k", type=int, default=None,
                   help="K, tokens drafted per round (auto policy: the most it may choose); default 4, or 8 for "
                        "smollm2's default prophets")


def _chat(args: argparse.Namespace, decoder: Any) -> bool:
    """Whether prompts are user messages in the chat template: --chat, --raw, or by default
    whenever the target's tokenizer has a chat template."""
    if args.chat and not getattr(decoder.tokenizer, "chat_template", None):
        raise SpecdecError("--chat: this model's tokenizer has no chat template; leave --chat out")
    if args.chat or args.raw:
        return bool(args.chat)
    return bool(getattr(decoder.tokenizer, "chat_template", None))


_JSON_OUT: list[Any] = []  # the real stdout while a --json command runs (everything else goes to stderr)


def _print_json(doc: Any) -> None:
    out = _JSON_OUT[-1] if _JSON_OUT else sys.stdout
    out.write(json.dumps(doc) + "\n")
    out.flush()


def _mebibytes(mib: float | None) -> int | None:
    return None if mib is None else int(mib * 2**20)


def _dtype(name: str) -> Any:
    from specdec.wiring import resolve_dtype

    return resolve_dtype(name)


def _load(args: argparse.Namespace) -> Any:
    from specdec.api import load

    return load(args.target, draft=args.draft, policy=args.policy, draft_tokens=args.draft_tokens,
                dtype=_dtype(args.dtype),
                multi=args.multi, trust_remote_code=args.trust_remote_code, retrieval_index=args.retrieval_index,
                backend=args.backend, device=args.device, prefix_cache_mb=getattr(args, "prefix_cache", 0.0),
                branches=args.branches, kv_dtype=args.kv_dtype)


def _stats_table(stats: Any, title: str) -> Any:
    from rich.table import Table

    t = Table(title=title, show_header=False)
    d = stats.to_dict()
    for key in ["rounds", "target_calls", "draft_calls", "drafted", "accepted", "recovered", "bonus", "cut",
                "new_tokens"]:
        t.add_row(key, str(d[key]))
    if d["forced"]:
        t.add_row("forced (by the grammar, no pass)", str(d["forced"]))
    t.add_row("acceptance_rate (accepted/drafted)", f"{d['acceptance_rate']:.3f}")
    t.add_row("alpha (per tested position)", f"{d['alpha']:.3f}")
    t.add_row("tokens_per_round", f"{d['tokens_per_round']:.2f}")
    t.add_row("acceptance by position", " ".join(f"{x:.2f}" for x in d["acceptance_by_position"]))
    t.add_row("wall / draft / target / other (s)",
              f"{d['wall_s']:.3f} / {d['draft_s']:.3f} / {d['target_s']:.3f} / {d['other_s']:.3f}")
    t.add_row("tokens/s", f"{d['tokens_per_s']:.1f}")
    return t


def _read_prompts(path: str, chat: bool) -> list[dict[str, Any]]:
    """One prompt per line: plain text, or a JSON object with "prompt" or "messages" and its
    own settings (max_new_tokens, temperature, top_k, top_p, seed, draft_tokens, sampling)."""
    try:
        lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"cannot read --prompts-file {path}: {e}") from None
    if not lines:
        raise SpecdecError(f"--prompts-file {path} has no prompts")
    jobs = []
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("{"):
            try:
                job = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecdecError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(job, dict) or not ({"prompt", "messages"} & set(job)):
                raise SpecdecError(f'{path}:{n}: a JSON line needs "prompt" or "messages"')
        else:
            job = {"messages": [{"role": "user", "content": line}]} if chat else {"prompt": line}
        jobs.append(job)
    return jobs


def _generate_many(args: argparse.Namespace, decoder: Any, settings: dict[str, Any]) -> int:
    from rich.console import Console

    jobs = _read_prompts(args.prompts_file, _chat(args, decoder))
    settings = {k: v for k, v in settings.items() if k not in ("prompt", "messages")}
    outs = decoder.generate_many(jobs, max_batch=args.max_batch, **settings)
    if args.json:
        _print_json([o.to_dict() for o in outs])
        return 0
    for job, out in zip(jobs, outs, strict=True):
        print(f"### {job.get('prompt') or job['messages'][-1]['content']}\n{out.text}\n")
    wall = max(o.stats.wall_s for o in outs)
    Console(stderr=True).print(f"{len(outs)} prompts, {sum(o.stats.new_tokens for o in outs)} tokens in "
                               f"{wall:.2f}s ({sum(o.stats.new_tokens for o in outs) / wall:.1f} tokens/s)")
    return 0


def _same_as_plain(args: argparse.Namespace) -> bool:
    """Whether speculative and plain decoding must give the same tokens: greedy, or coupled
    sampling with a seed (the same keyed draws on both sides)."""
    return args.temperature == 0 or (args.sampling == "coupled" and args.seed is not None)


def _greedy_difference(args: argparse.Namespace) -> str:
    if not _same_as_plain(args):
        return ""
    what = "greedy" if args.temperature == 0 else "seeded coupled"
    if args.dtype in ("bfloat16", "auto"):
        return (f" ({what} tokens differ from plain decoding: with a bfloat16 target on the transformers backend, "
                "scoring several tokens in one pass rounds differently from scoring one at a time)")
    return f" ({what} tokens differ from plain decoding)"


def _nothing_drafted(decoder: Any) -> str:
    """Why speculation was plain decoding this time, for a run that drafted no token."""
    if not decoder.prophets:
        return "drafted 0 tokens: no prophet (--draft none), so this is plain decoding"
    names = ", ".join(d.name for d in decoder.prophets)
    return (f"drafted 0 tokens: {names} proposed nothing for this prompt, so this was plain decoding (prompt lookup "
            "and retrieval draft where the text repeats; the auto policy drafts only where the measured step costs "
            "say a draft pays)")


def cmd_chat(args: argparse.Namespace) -> int:
    """A conversation in the terminal: each line on stdin is the user's next message, the answer
    streams to stdout, the whole conversation goes back each turn (read from the prefix cache up
    to where it is new). `/reset` forgets it; an empty line is skipped; end of input ends."""
    from specdec.api import check_prefix_cache_mb
    from specdec.sampling import SAMPLING_MODES

    check_prefix_cache_mb(args.prefix_cache)  # before the models load; one line, exit 2
    if args.sampling not in SAMPLING_MODES:
        raise SpecdecError(f"--sampling must be one of {', '.join(SAMPLING_MODES)}, got {args.sampling!r}")
    decoder = _load(args)
    if not getattr(decoder.tokenizer, "chat_template", None):
        raise SpecdecError("this model's tokenizer has no chat template: use `specdec generate --raw`")
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    settings: dict[str, Any] = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_k=args.top_k, top_p=args.top_p, seed=args.seed, sampling=args.sampling)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            messages = list(start)
            print("(conversation reset)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        cache = decoder.prefix_cache
        before = cache.stats.hit_tokens if cache is not None else 0
        prompt_tokens = len(decoder.chat_ids(messages))
        events, answer = [], ""
        for event in decoder.stream(messages=messages, **settings):
            sys.stdout.write(event.text)
            sys.stdout.flush()
            answer += event.text
            events.append(event)
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": answer})
        from specdec.stats import summarize

        st = summarize(events)
        cache = decoder.prefix_cache
        cached = (cache.stats.hit_tokens if cache is not None else 0) - before
        print(f"[{st.new_tokens} tokens, {st.tokens_per_s:.1f} tokens/s, {st.tokens_per_round:.2f} a round; "
              f"prompt {prompt_tokens} tokens, {cached} from the prefix cache]", file=sys.stderr)


def _read_text(path: str, what: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"cannot read the {what} {path}: {e.strerror if isinstance(e, OSError) else e}") from None


def _constraint_args(args: argparse.Namespace) -> dict[str, Any]:
    """The output constraint the flags ask for (--json-schema FILE, --json-object, --regex,
    --grammar FILE), as generate's keywords; its shape checked before the models load."""
    from specdec.grammar import check_grammar, grammar_of, json_schema_grammar

    given = [f for f, v in (("--json-schema", args.json_schema), ("--json-object", args.json_object),
                            ("--regex", args.regex), ("--grammar", args.grammar)) if v]
    if len(given) > 1:
        raise SpecdecError("pass one of --json-schema, --json-object, --regex and --grammar, "
                           f"not {' and '.join(given)}")
    out: dict[str, Any] = {}
    if args.json_schema:
        schema = json.loads(json_schema_grammar(_read_text(args.json_schema, "JSON schema")).source)
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
    elif args.json_object:
        out["response_format"] = {"type": "json_object"}
    elif args.regex:
        out["regex"] = args.regex
    elif args.grammar:
        out["grammar"] = _read_text(args.grammar, "grammar")
    spec = grammar_of(**out)
    if spec is not None:
        check_grammar(spec)
    return out


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specdec.sampling import SAMPLING_MODES

    if (args.prompt is None) == (args.prompts_file is None):
        raise SpecdecError("give a prompt or --prompts-file FILE (not both)")
    if args.sampling not in SAMPLING_MODES:  # before the models load; one line, exit 2
        raise SpecdecError(f"--sampling must be one of {', '.join(SAMPLING_MODES)}, got {args.sampling!r}")
    constraint = _constraint_args(args)
    decoder = _load(args)
    chat = _chat(args, decoder)
    settings: dict[str, Any] = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop or None,
                                    sampling=args.sampling, **constraint)
    if chat:  # the prompt is the user's message, formatted with the model's chat template
        settings["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        settings["prompt"] = args.prompt
    if args.prompts_file:
        return _generate_many(args, decoder, settings)
    plain = decoder.plain() if args.compare else None
    if plain is not None:  # warm both sides up (first-call allocations, kernels), so the timed runs are fair
        warm = {**settings, "max_new_tokens": min(8, args.max_new_tokens or 8)}
        decoder.generate(**warm)
        plain.generate(**warm)
    if args.json:
        out = decoder.generate(**settings)
        d = out.to_dict()
        if plain is not None:
            d["plain"] = plain.generate(**settings).to_dict()
        _print_json(d)
        return 0
    err = Console(stderr=True)
    sys.stdout.write(args.prompt + ("\n" if chat else ""))
    events = []
    for event in decoder.stream(**settings):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        events.append(event)
    sys.stdout.write("\n")
    from specdec.stats import summarize

    stats = summarize(events)
    title = "plain decoding" if not decoder.prophets else \
        f"speculative decoding ({', '.join(d.name for d in decoder.prophets)}, policy {args.policy})"
    err.print(_stats_table(stats, title))
    if stats.drafted == 0 and (decoder.prophets or plain is not None):
        err.print(_nothing_drafted(decoder), markup=False, soft_wrap=True)
    if plain is not None:
        base = plain.generate(**settings)
        same = _same_as_plain(args) and base.token_ids == [t for e in events for t in e.committed]
        err.print(f"plain decoding: {base.stats.wall_s:.3f}s for {base.stats.new_tokens} tokens; "
                  f"speculative: {stats.wall_s:.3f}s for {stats.new_tokens}; "
                  f"speedup {base.stats.wall_s / stats.wall_s * stats.new_tokens / max(base.stats.new_tokens, 1):.2f}x"
                  + (" (identical tokens)" if same else _greedy_difference(args)))
    if args.timeline:
        from specdec.viz import plot_timeline

        plot_timeline(events, args.timeline, tokenizer=decoder.tokenizer)
        err.print(f"timeline written to {args.timeline}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from specdec.check import certify

    decoder = _load(args)
    if not decoder.prophets:
        raise SpecdecError("check needs a prophet: plain decoding is compared with itself")
    plain = decoder.plain()
    err = Console(stderr=True)
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task("sampling (speculative, plain)", total=args.samples)
        report = certify(decoder, plain, args.prompt, tokens=args.tokens, samples=args.samples, alpha=args.alpha,
                         seed=args.seed or 0, progress=lambda n: bar.update(task, completed=n),
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    r = report.result
    vacuous = report.drafted == 0  # then speculation was plain decoding: the test compared it with itself
    why = (f"nothing was drafted in {r.n_a} samples of {args.tokens} tokens, so the test compared plain "
           "decoding with itself: use more --tokens (a feature prophet drafts from the second round on)")
    if args.json:
        _print_json(report.to_dict() | ({"inconclusive": why} if vacuous else {}))
    else:
        print(f"samples: {r.n_a} speculative, {r.n_b} plain; {args.tokens} tokens each; "
              f"distinct continuations {report.distinct_spec} / {report.distinct_plain}; "
              f"acceptance rate {report.acceptance_rate:.3f}")
        print(f"chi-square test of homogeneity: statistic {r.statistic:.2f}, dof {r.dof}, p-value {r.p_value:.4g}")
        print(r.verdict)
        if r.dof < 5:
            print(f"warning: only {r.dof + 1} cells after pooling rare continuations, so the test has little "
                  "power; use fewer --tokens, more --samples or a more predictable --prompt")
        if vacuous:
            print(f"INCONCLUSIVE: {why}")
    return 0 if r.passed and not vacuous else 1


def cmd_calibrate(args: argparse.Namespace) -> int:
    from specdec import coststore

    decoder = _load(args)
    if not decoder.prophets:
        raise SpecdecError("nothing to measure: with no prophet every step is a plain step (no K to choose)")
    if args.again:
        coststore.forget(decoder.costs_key())
    costs = decoder.stored_costs()
    doc = {"key": decoder.costs_key(), "costs": costs.to_dict()}
    if args.json:
        _print_json(doc)
        return 0
    for label, c in (("greedy", costs), ("temperature 1", costs.sampled)):
        if c is None:
            continue
        curve = ", ".join(f"{n}: {t / c.t_plain:.2f}" for n, t in sorted(c.t_verify.items()))
        drafts = ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in c.t_draft_by.items())
        print(f"{label}: plain step {c.t_plain * 1e3:.2f} ms (spread {c.spread:.0%}); tokens scored -> plain steps "
              f"{curve}; drafting a token: {drafts or 'free'}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from specdec.defaults import shipped
    from specdec.train.pipeline import load_config, prepare, train_target

    cfg = load_config(Path(shipped(args.config)))
    work = Path(args.work_dir)
    prepare(cfg, work, Path(args.corpus_root) if args.corpus_root else None)
    train_target(cfg, work, Path(args.out), minutes=args.minutes, max_steps=args.max_steps)
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from specdec.defaults import shipped
    from specdec.train.pipeline import distill, load_config
    from specdec.wiring import check_model_dir

    cfg = load_config(Path(shipped(args.config)))
    if "paths" in cfg:  # prophets for a real target (configs/smollm2.toml): self-distillation + feature heads
        from specdec.train.smollm2 import run

        run(cfg, work_dir=Path(args.work_dir) if args.work_dir else None,
            models_dir=Path(args.models_dir) if args.models_dir else None, only=args.only,
            max_steps=args.max_steps, data_minutes=args.data_minutes, train_minutes=args.distill_minutes)
        return 0
    work, target = Path(args.work_dir or ".cache/bundled"), shipped(args.target)
    if Path(target).is_file() or check_model_dir(target, "target") is None:
        raise SpecdecError(f"--target '{target}': this config distills from a local model directory (`specdec train` "
                           "writes one), not a file or a Hugging Face id")
    if not (work / "train.bin").is_file():
        raise SpecdecError(f"--work-dir {work} holds no prepared corpus (train.bin): run `specdec train --work-dir "
                           f"{work}` first")
    distill(cfg, work, Path(target), Path(args.out),
            data_out_dir=Path(args.data_out) if args.data_out else None, data_minutes=args.data_minutes,
            distill_minutes=args.distill_minutes, max_steps=args.max_steps)
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from specdec.defaults import default_target
    from specdec.prophets.retrieval import build_default_datastore, default_index_path
    from specdec.wiring import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or default_target(), role="tokenizer")
    out = Path(args.out) if args.out else default_index_path(tokenizer)
    build_default_datastore(tokenizer, out)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import os

    import uvicorn

    from specdec.heap import one_heap
    from specdec.server import ServerConfig, create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    config = ServerConfig(api_key=args.api_key or os.environ.get("SPECDEC_API_KEY") or None,
                          max_batch=args.max_batch, max_queue=args.max_queue, timeout_s=args.timeout or None,
                          max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens_limit,
                          max_draft_tokens=args.max_draft_tokens, prefill_chunk=args.prefill_chunk,
                          kv_memory=_mebibytes(args.kv_memory), prefix_cache_mb=args.prefix_cache)
    if config.max_batch < 1 or config.max_queue < 0:
        raise ValueError("--max-batch must be >= 1 and --max-queue >= 0")
    if config.prefill_chunk < 1 or (config.kv_memory is not None and config.kv_memory < 1):
        raise ValueError("--prefill-chunk and --kv-memory must be >= 1")
    if not 0 <= config.prefix_cache_mb < float("inf"):
        raise ValueError("--prefix-cache must be a finite number of MiB >= 0")
    if args.replicas is not None or args.autoscale is not None or args.address is not None:
        return _serve_replicas(args, config)
    one_heap()  # a server's memory goes back after a long prompt (see one_heap)
    decoder = _load(args)
    uvicorn.run(create_app(decoder, args.model_name, config), host=args.host, port=args.port, log_level="info",
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0


def _serve_replicas(args: argparse.Namespace, config: Any) -> int:
    """`serve` as a Ray Serve application (only here is ray imported)."""
    if args.cpus_per_replica <= 0 or args.gpus_per_replica < 0:
        raise SpecdecError("--cpus-per-replica must be > 0 and --gpus-per-replica >= 0")
    if args.gpus_per_replica > 0 and args.device == "cpu":
        raise SpecdecError("--gpus-per-replica: also give --device cuda (or auto), or the replicas decode on the CPU")
    from specdec.server.replicas import ReplicaSpec, parse_scale, run_replicas

    scale = parse_scale(args.replicas, args.autoscale)
    spec = ReplicaSpec(load=dict(target=args.target, draft=args.draft, policy=args.policy,
                                 draft_tokens=args.draft_tokens, dtype=args.dtype, multi=args.multi,
                                 trust_remote_code=args.trust_remote_code, retrieval_index=args.retrieval_index,
                                 backend=args.backend, device=args.device, kv_dtype=args.kv_dtype),
                       model_name=args.model_name, config=config, threads=max(1, round(args.cpus_per_replica)))
    return int(run_replicas(spec, scale, address=args.address, host=args.host, port=args.port,
                            cpus_per_replica=args.cpus_per_replica, gpus_per_replica=args.gpus_per_replica,
                            shutdown_timeout_s=args.shutdown_timeout))


def cmd_bench(args: argparse.Namespace) -> int:
    from specdec.bench.main import run_bench

    args.command_line = "specdec " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "specdec bench"
    run_bench(args)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (what is wrong and what the choices are), exit code 2,
    without the usage block: `specdec COMMAND --help` shows that."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdec", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, printing it as it is verified")
    g.add_argument("prompt", nargs="?", default=None)
    g.add_argument("--prompts-file", default=None,
                   help="many prompts, one per line (text, or JSON with its own settings), run as one batch")
    g.add_argument("--max-batch", type=int, default=16, help="rows decoded together with --prompts-file")
    _model_args(g)
    _sampling_args(g)
    g.add_argument("--sampling", default="rejection", metavar="{rejection,coupled}",
                   help="rejection (default): the verifier's own draws; coupled: every draw keyed by --seed and "
                        "the token's position, so a seeded output is seeded plain coupled sampling's, token for "
                        "token, whatever the prophet, K or batch (an exact sample of the target either way)")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"the most tokens to generate (default {MAX_NEW_TOKENS}, or the room the prompt leaves in the "
                        "context if that is less)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="the answer is JSON valid against this JSON schema (constrained decoding, exact)")
    g.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    g.add_argument("--regex", default=None, help="the answer matches this regular expression")
    g.add_argument("--grammar", default=None, metavar="FILE", help="the answer follows this Lark grammar")
    g.add_argument("--json", action="store_true",
                   help="print one JSON document on stdout and nothing else (text, token_ids, stats); "
                        "progress and notes go to stderr")
    g.add_argument("--compare", action="store_true",
                   help="also run plain decoding (both warmed up first) and print the speedup")
    form = g.add_mutually_exclusive_group()
    form.add_argument("--chat", action="store_true", default=None,
                      help="the prompt is a user message in the model's chat template (the default for a model "
                           "with a chat template, such as smollm2)")
    form.add_argument("--raw", action="store_true",
                      help="plain completion: the prompt is continued as it is (the default for a model with no "
                           "chat template, such as bundled)")
    g.add_argument("--timeline", default=None, help="write a picture of every round to this PNG")
    g.set_defaults(func=cmd_generate)

    ch = sub.add_parser("chat", help="a conversation in the terminal: a line on stdin per message, answers streamed")
    _model_args(ch)
    _sampling_args(ch)
    ch.add_argument("--sampling", default="rejection", metavar="{rejection,coupled}",
                    help="as for generate")
    ch.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"the most tokens an answer may have (default {MAX_NEW_TOKENS})")
    ch.add_argument("--system", default=None, help="a system message that starts the conversation")
    ch.add_argument("--prefix-cache", type=float, default=256.0, metavar="MIB",
                    help="MiB of the conversation's keys and values kept between turns, so each turn reads only "
                         "what is new, with the same answers (default 256; 0: none)")
    ch.set_defaults(func=cmd_chat)

    c = sub.add_parser("check", help="statistical certificate that speculation leaves the distribution unchanged")
    _model_args(c)
    _sampling_args(c)
    c.add_argument("--prompt", default="import os\nimport sys\nimport ",
                   help="a prompt whose continuations repeat often enough to fill the test's cells")
    c.add_argument("--tokens", type=int, default=3,
                   help="length of each sampled continuation (at least 3 for a feature prophet to draft)")
    c.add_argument("--samples", type=int, default=600, help="continuations sampled each way")
    c.add_argument("--alpha", type=float, default=0.001, help="significance level")
    c.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else")
    c.set_defaults(func=cmd_check)

    cal = sub.add_parser("calibrate", help="the step costs K is chosen from on this machine: shown, or measured "
                                           "again with --again (stored once per machine and settings)")
    _model_args(cal)
    cal.add_argument("--draft-tokens", "-k", type=int, default=None,
                     help="the largest K the costs are measured for (default: the target's default K)")
    cal.add_argument("--again", action="store_true", help="forget the stored costs and measure them again now")
    cal.add_argument("--json", action="store_true", help="print the key and costs as one JSON document")
    cal.set_defaults(func=cmd_calibrate)

    t = sub.add_parser("train", help="train the tokenizer and the target on the stdlib corpus")
    t.add_argument("--config", default="configs/bundled.toml",
                   help="a config file (configs/NAME.toml: a shipped one, unless that path exists here)")
    t.add_argument("--work-dir", default=".cache/bundled")
    t.add_argument("--out", default="models/target", help="where the target is written (under this directory)")
    t.add_argument("--corpus-root", default=None, help="corpus directory (default: this Python's stdlib)")
    t.add_argument("--minutes", type=float, default=None, help="override the config's training time")
    t.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke runs)")
    t.set_defaults(func=cmd_train)

    d = sub.add_parser("distill", help="train the prophet on the data, then distill it from a target")
    d.add_argument("--config", default="configs/bundled.toml",
                   help="a config file (configs/NAME.toml: a shipped one, unless that path exists here)")
    d.add_argument("--work-dir", default=None, help="intermediate state (default: the config's, or .cache/bundled)")
    d.add_argument("--models-dir", default=None, help="where a real target's prophets are exported (config: models)")
    d.add_argument("--only", nargs="*", default=None, help="only these prophets (eagle, medusa, kangaroo)")
    d.add_argument("--target", default="models/target",
                   help="the target to distill from (models/target: `specdec train`'s, else the shipped one)")
    d.add_argument("--out", default="models/prophet", help="where the prophet is written (under this directory)")
    d.add_argument("--data-out", default=None, help="also save the data-only prophet here")
    d.add_argument("--data-minutes", type=float, default=None)
    d.add_argument("--distill-minutes", type=float, default=None)
    d.add_argument("--max-steps", type=int, default=None)
    d.set_defaults(func=cmd_distill)

    ix = sub.add_parser("index", help="build the retrieval datastore (suffix array over the training corpus)")
    ix.add_argument("--tokenizer", default=None,
                    help="tokenizer to index with: a model id, path, smollm2 or bundled (default: smollm2's)")
    ix.add_argument("--out", default=None, help="where to write it (default: the cache used by --draft retrieval)")
    ix.set_defaults(func=cmd_index)

    sv = sub.add_parser("serve", help="OpenAI-compatible server: completions, chat, streaming, web view at /")
    _model_args(sv)
    sv.add_argument("--draft-tokens", "-k", type=int, default=None,
                    help="default K (4; the auto policy's most); requests may ask for another")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--model-name", default="specdec", help="the model id clients send and /v1/models lists")
    sv.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                         "(default: $SPECDEC_API_KEY; none when unset)")
    sv.add_argument("--max-batch", type=int, default=64,
                    help="requests decoded together: the rows of one batched step")
    sv.add_argument("--max-queue", type=int, default=256, help="requests waiting beyond the batch; more get 429")
    sv.add_argument("--timeout", type=float, default=600.0,
                    help="per-request deadline in seconds from arrival (0 = none); a request past it stops")
    sv.add_argument("--max-body-bytes", type=int, default=2_000_000, help="larger request bodies get 413")
    sv.add_argument("--max-tokens-limit", type=int, default=4096, help="the largest max_tokens a request may ask")
    sv.add_argument("--max-draft-tokens", type=int, default=16,
                    help="the largest specdec.draft_tokens a request may ask")
    sv.add_argument("--shutdown-timeout", type=float, default=3.0,
                    help="seconds open requests get to finish after SIGTERM before they are cut off")
    sv.add_argument("--kv-memory", type=float, default=None, metavar="MIB",
                    help="MiB of KV cache the batched requests may reserve together (each reserves what its prompt "
                         "and max_tokens can reach; more wait; one that could never fit gets a 400); default: half "
                         "of the memory available at startup")
    sv.add_argument("--prefix-cache", type=float, default=SERVE_PREFIX_CACHE_MB, metavar="MIB",
                    help="MiB of prompt prefixes' keys and values to keep, so that a prompt that starts as an "
                         "earlier one did (the next turn of a chat, a shared system prompt) is read from where they "
                         f"part, with the same answer (default {SERVE_PREFIX_CACHE_MB:g}; 0: none)")
    sv.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="TOKENS",
                    help=f"prompt tokens prefilled per batched step, between the running rows' steps: the longest "
                         f"a stream waits for a joining prompt (default {PREFILL_CHUNK})")
    ray_opts = sv.add_argument_group("replicas (Ray Serve; pip install 'specdec[ray]')")
    ray_opts.add_argument("--replicas", type=int, default=None, metavar="N",
                          help="serve the same API from N replica processes, each with its own decoder and "
                               "continuous batching, as a Ray Serve application")
    ray_opts.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                          help="like --replicas, with Ray Serve adding and removing replicas between MIN and MAX "
                               "with the load (a replica's target is --max-batch requests at once)")
    ray_opts.add_argument("--address", default=None, metavar="ADDR",
                          help="the Ray cluster to run on: auto (the one `ray start` began on this machine) or "
                               "HEAD:6379; default with --replicas/--autoscale: a one-node cluster started here")
    ray_opts.add_argument("--cpus-per-replica", type=float, default=1.0,
                          help="CPUs Ray reserves for each replica; also its torch threads (default 1)")
    ray_opts.add_argument("--gpus-per-replica", type=float, default=0.0,
                          help="GPUs Ray reserves for each replica (with --device cuda; fractions share a GPU)")
    sv.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="side-by-side speed report against plain decoding and Hugging Face")
    b.add_argument("--quick", action="store_true", help="8 prompts, 64 tokens, the main configurations")
    b.add_argument("--configs", nargs="*", default=None, help="only these configurations (plain always runs)")
    b.add_argument("--out", default="bench-out", help="directory for bench.json, bench.md and the plots")
    b.add_argument("--modes", default="greedy,sampling", help="greedy, sampling or both")
    b.add_argument("--max-new-tokens", type=int, default=None)
    b.add_argument("--per-category", type=int, default=None, help="prompts per category")
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("-k", type=int, default=4, help="K of the fixed-K configurations")
    b.add_argument("--target", default=None)
    b.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, mps or auto")
    b.add_argument("--prophet", default=None)
    b.add_argument("--dtype", default="default", choices=["default", "float32", "bfloat16", "auto", "int4"],
                   help="the target's weights for every configuration (default: as `specdec run` loads the "
                        "target: int4 for smollm2 on the CPU, float32 for other models)")
    b.add_argument("--suite", default="auto", choices=["auto", "code", "chat", "spec-bench", "structured"],
                   help="prompts: code (stdlib, bundled pair) or chat (instruct targets; auto: chat for smollm2); "
                        "spec-bench: Spec-Bench's questions (--questions), plain decoding against the target's "
                        "default decoder, per task and overall: speedup, tokens per target pass, acceptance; "
                        "structured: 51 JSON schemas and 10 tool calls, speculative and plain constrained "
                        "decoding and plain unconstrained, validity (jsonschema), forced tokens, mask time "
                        "(--quick: 10 and 4; --per-category N: N schemas)")
    b.add_argument("--questions", default=None, metavar="FILE",
                   help="--suite spec-bench: Spec-Bench's question.jsonl (one {question_id, category, turns} "
                        "object per line; the first turn of each is asked)")
    b.add_argument("--per-task", type=int, default=None, metavar="N",
                   help="--suite spec-bench: questions per task (default 5; 0 = all)")
    b.add_argument("--draft", action="append", default=None, metavar="SPEC",
                   help="--suite spec-bench: the prophets to measure, as specdec.load's draft (repeatable, one "
                        "configuration each; default: default, the target's own prophets with its own K and policy)")
    b.add_argument("--branches", default=None, metavar="LIST",
                   help="--suite spec-bench: each --draft once per value of this comma list (1: chains; N > 1: an "
                        "eagle grows token trees of up to N children a node), e.g. 1,4 (default 1)")
    b.add_argument("--peers", default=None, metavar="NAMES",
                   help="other engines decoding the same prompts, interleaved with specdec's configurations (comma "
                        "list): llama.cpp (llama-cpp-python on the target's own GGUF file, plain and its prompt "
                        'lookup; pip install -e ".[llamacpp]")')
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "json", False):
            # One JSON document on stdout and nothing else: whatever else a command or a library
            # prints on the way (first-run conversions, datastore builds) goes to stderr.
            import contextlib

            _JSON_OUT.append(sys.stdout)
            try:
                with contextlib.redirect_stdout(sys.stderr):
                    return int(args.func(args))
            finally:
                _JSON_OUT.pop()
        return int(args.func(args))
    except (SpecdecError, ValueError, OSError) as e:  # bad input, a missing or unreadable file: one line
        print(f"specdec: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # a fault of specdec's own: still one line, the traceback where asked for
        import os

        if os.environ.get("SPECDEC_TRACEBACK"):
            raise
        print(f"specdec: internal error: {type(e).__name__}: {_one_line(e)} (run again with SPECDEC_TRACEBACK=1 "
              "to see where, and report it)", file=sys.stderr)
        return 1


def _one_line(e: BaseException) -> str:
    from specdec.wiring import one_line

    return one_line(e, limit=1000)


if __name__ == "__main__":
    sys.exit(main())
