"""The `specdec` command line: generate, check, train, distill, index, bench, serve."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specdec.errors import SpecdecError


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
    from specdec.defaults import TRAINED_PROPHET, distill_target, shipped
    from specdec.train.pipeline import distill, load_config
    from specdec.wiring import check_model_dir

    if args.minutes is not None:
        return _distill_any(args)
    cfg = load_config(Path(shipped(args.config or "configs/bundled.toml")))
    if "paths" in cfg:  # prophets for a real target (configs/smollm2.toml): self-distillation + feature heads
        from specdec.train.smollm2 import run

        run(cfg, work_dir=Path(args.work_dir) if args.work_dir else None,
            models_dir=Path(args.models_dir) if args.models_dir else None, only=args.only,
            max_steps=args.max_steps, data_minutes=args.data_minutes, train_minutes=args.distill_minutes)
        return 0
    work, target = Path(args.work_dir or ".cache/bundled"), distill_target(args.target)
    if Path(target).is_file() or check_model_dir(target, "target") is None:
        raise SpecdecError(f"--target '{target}': this config distills from a local model directory (`specdec train` "
                           "writes one), not a file or a Hugging Face id")
    if not (work / "train.bin").is_file():
        raise SpecdecError(f"--work-dir {work} holds no prepared corpus (train.bin): run `specdec train --work-dir "
                           f"{work}` first")
    distill(cfg, work, Path(target), Path(args.out or TRAINED_PROPHET),
            data_out_dir=Path(args.data_out) if args.data_out else None, data_minutes=args.data_minutes,
            distill_minutes=args.distill_minutes, max_steps=args.max_steps)
    return 0


def _distill_any(args: argparse.Namespace) -> int:
    """`specdec distill --target X --minutes N` (specdec.train.anytarget), then `specdec check` on the result."""
    from specdec.train.anytarget import Settings, agreement_line, run

    if args.config is not None:
        raise SpecdecError("--minutes trains a prophet for --target with no config file: drop --config (or --minutes)")
    if not args.target:
        raise SpecdecError("--minutes needs --target: the model to train a prophet for")
    if (args.prompts is not None and args.prompts < 1) or args.batch_size < 1 or args.max_new_tokens < 1:
        raise SpecdecError("--prompts, --batch-size and --max-new-tokens must be >= 1")
    if (args.max_steps is not None and args.max_steps < 1) or args.check_samples < 0:
        raise SpecdecError("--max-steps must be >= 1 and --check-samples >= 0")
    settings = Settings(prompts=args.prompts, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                        max_steps=args.max_steps)
    err = sys.stderr
    out, meta = run(args.target, args.minutes, Path(args.out) if args.out else None, settings,
                    log=lambda line: print(line, file=err, flush=True))
    print(f"prophet: {out}")
    print(agreement_line(meta))
    if args.check_samples == 0:
        return 0
    print(f"specdec check --target {args.target} --draft {out} --temperature 1 --samples {args.check_samples}:")
    check = build_parser().parse_args(["check", "--target", args.target, "--draft", str(out), "--temperature", "1",
                                       "--samples", str(args.check_samples)])
    return cmd_check(check)


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


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (`specdec.cliparser`), each command handled here."""
    from specdec import cliparser

    return cliparser.build_parser({"generate": cmd_generate, "chat": cmd_chat, "check": cmd_check,
                                   "calibrate": cmd_calibrate, "train": cmd_train, "distill": cmd_distill,
                                   "index": cmd_index, "serve": cmd_serve, "bench": cmd_bench})


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
