"""`specdec bench`: load, warm up, run interleaved, write JSON / markdown / plots."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specdec.bench.peers import attach_peers, check_peers, peer_info, peer_summary, peers_markdown
from specdec.bench.report import (
    SPEC_BENCH_LEADERBOARD,
    by_category,
    by_task,
    markdown,
    nothing_drafted,
    plots,
    specbench_markdown,
    summarize_config,
)
from specdec.bench.report import fmt as _f
from specdec.bench.roofline import roofline, roofline_line
from specdec.bench.runner import Config, Run, Runner, hf_generate_fn, interleaved, measure_costs
from specdec.costmodel import OtherLoad
from specdec.data.chat import CHAT_CATEGORIES, chat_prompts
from specdec.data.prompts import CATEGORIES, BenchPrompt, build_suite
from specdec.defaults import cpu_model, default_prophet_for, default_target, display_name, is_alias
from specdec.errors import SpecdecError

K = 4  # the default draft length of the benchmark's fixed-K configurations


def configs_for(quick: bool, greedy: bool, k: int = K) -> list[Config]:
    base = [Config("plain", "ours"), Config("plain (again)", "ours")]
    peers = [Config("hf plain", "hf-plain"), Config(f"hf assisted K={k}", "hf-assisted", k=k)]
    if greedy:
        peers.append(Config("hf prompt-lookup", "hf-lookup", k=10))
    default = Config("prophet auto (default)", "ours", "default", "auto", k=k)  # what load("bundled") runs
    if quick:
        mine = [default, Config(f"prophet K={k}", "ours", "default", k=k)]
        if greedy:
            mine.append(Config("ngram", "ours", "ngram", k=8))
        return base + mine + peers
    peers.insert(2, Config("hf assisted (defaults)", "hf-assisted", k=0))
    mine = [default] + [Config(f"prophet K={kk}", "ours", "default", k=kk) for kk in (2, k, 6)]
    mine += [Config("prophet adaptive", "ours", "default", "adaptive", k=k),
             Config("prophet confidence", "ours", "default", "confidence", k=8),
             Config("prophet optimal", "ours", "default", "optimal", k=k),
             Config("ngram", "ours", "ngram", k=8),
             Config("retrieval", "ours", "retrieval", k=6),
             Config("layerskip:auto", "ours", "layerskip", k=3),
             Config("prophet+ngram tree", "ours", "default+ngram", k=k),
             Config("prophet+ngram best", "ours", "default+ngram", k=k, multi="best")]
    return base + mine + peers


def chat_configs_for(quick: bool, greedy: bool, k: int = K) -> list[Config]:
    """The real chat target (smollm2) and its prophets, plain decoding and transformers.
    transformers' assisted generation needs a smaller model with the same tokenizer, which
    SmolLM2-135M does not have (it is the smallest of its family); its prompt lookup runs."""
    from specdec.defaults import models_dir

    eagle, medusa = str(models_dir() / "smollm2-eagle"), str(models_dir() / "smollm2-medusa")
    kangaroo = str(models_dir() / "smollm2-kangaroo")
    base = [Config("plain", "ours"), Config("plain (again)", "ours")]
    peers = [Config("hf plain", "hf-plain")] + ([Config("hf prompt-lookup", "hf-lookup", k=10)] if greedy else [])
    # what load("smollm2") runs: prompt lookup first, eagle elsewhere, auto K up to 8
    default = Config("ngram+eagle first K<=8 (default)", "ours", f"ngram+{eagle}", "auto", k=8, multi="first")
    if quick:
        return base + [default, Config("ngram auto", "ours", "ngram", "auto", k=k)] + peers
    mine = [default,
            Config(f"ngram+eagle first K<={k}", "ours", f"ngram+{eagle}", "auto", k=k, multi="first"),
            Config("ngram auto", "ours", "ngram", "auto", k=k),
            Config("ngram auto K<=8", "ours", "ngram", "auto", k=8),
            Config("eagle auto", "ours", eagle, "auto", k=k),
            Config(f"eagle K={k}", "ours", eagle, "fixed", k=k),
            Config("medusa auto", "ours", medusa, "auto", k=2),
            Config("kangaroo auto", "ours", kangaroo, "auto", k=k),
            Config("int8 auto", "ours", "smollm2:int8", "auto", k=k),
            Config("eagle+ngram best", "ours", f"{eagle}+ngram", "auto", k=k, multi="best")]
    return base + mine + peers


def _draft_spec(spec: str, prophet_path: str) -> str:
    """A configuration's draft with "default" replaced by the prophet (a spec of its own: its parts
    once each)."""
    parts = [q for p in spec.split("+") for q in (prophet_path.split("+") if p == "default" else [p])]
    return "+".join(dict.fromkeys(parts))


def bench_prophet(target: str | None, prophet: str | None) -> str:
    """The prophet the bench's "default" configurations draft with: --prophet, else the target's own
    default (`defaults.default_prophet_for`: the bundled prophet for the bundled target, a trained
    eagle or prompt lookup for any other model)."""
    from specdec.defaults import default_target, shipped

    return shipped(prophet) if prophet else default_prophet_for(target or default_target())


def is_model_dir(spec: str) -> bool:
    """Whether a prophet spec is one model directory (what transformers' assisted generation needs)."""
    return "+" not in spec and (Path(spec) / "config.json").is_file()


def load_runner(configs: list[Config], settings: dict[str, Any], target: str | None, prophet: str,
                dtype: torch.dtype | None = None, device: str = "cpu") -> Runner:
    """The decoders and transformers callables of `configs`; prophet: `bench_prophet`'s, which
    "default" in a configuration's draft stands for."""
    from specdec.api import load
    from specdec.defaults import default_target

    target = target or default_target()
    runner = Runner(settings)
    plain = None
    for cfg in configs:
        if cfg.kind == "ours":
            draft = cfg.draft if cfg.as_given else _draft_spec(cfg.draft, prophet)
            dec = load(target, draft=draft, policy=cfg.policy, draft_tokens=(cfg.k or None) if cfg.as_given else cfg.k,
                       dtype=dtype, multi=cfg.multi, device=device, branches=cfg.branches)
            runner.decoders[cfg.name] = dec
            plain = plain or dec
    assert plain is not None, "the configurations need plain decoding as the baseline"
    model = plain.target.model  # type: ignore[attr-defined]
    eos = sorted(plain.eos_token_ids)
    for cfg in configs:
        if cfg.kind == "hf-plain":
            runner.hf[cfg.name] = hf_generate_fn(model, settings, eos)
        elif cfg.kind == "hf-assisted":
            from transformers import AutoModelForCausalLM

            # its own copy: transformers keeps schedule state on the assistant's generation config
            draft_model = AutoModelForCausalLM.from_pretrained(prophet, dtype=torch.float32).to(model.device).eval()
            if cfg.k:  # K fixed as ours; k=0 keeps transformers' defaults (20, confidence threshold 0.4)
                draft_model.generation_config.num_assistant_tokens = cfg.k
                draft_model.generation_config.num_assistant_tokens_schedule = "constant"
                draft_model.generation_config.assistant_confidence_threshold = 0.0
            runner.hf[cfg.name] = hf_generate_fn(model, settings, eos, assistant_model=draft_model)
        elif cfg.kind == "hf-lookup":
            runner.hf[cfg.name] = hf_generate_fn(model, settings, eos, prompt_lookup_num_tokens=cfg.k)
    return runner


def machine_info() -> dict[str, Any]:
    import transformers

    cpu = cpu_model()
    from specdec.wiring import default_draft_dtype

    return {"platform": platform.platform(), "cpu": cpu, "native_bf16": default_draft_dtype() == torch.bfloat16,
            "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads()}


def machine_line(machine: dict[str, Any]) -> str:
    """The machine as the reports name it: processor, bf16, threads, GPU, versions."""
    gpu = f", GPU {machine['gpu']}" if "gpu" in machine else ""
    busy = (f"; other processes used {machine['other_load_cores']:.2f} cores on average during the run"
            if "other_load_cores" in machine else "")
    return (f"{machine['cpu']} ({'native bf16' if machine['native_bf16'] else 'no native bf16'}), "
            f"{machine['threads']} threads{gpu}, torch {machine['torch']}, transformers {machine['transformers']}"
            + busy)


def _machine(args: Any, load: OtherLoad) -> dict[str, Any]:
    """The machine, and how busy other processes kept it while the bench ran (`OtherLoad`: a run
    taken while something else used the CPU says little about this code's speed)."""
    machine = machine_info()
    machine["other_load_cores"] = round(load.cores(), 3)
    device = getattr(args, "device", "cpu")
    if device != "cpu" and torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name(torch.device(device if device != "auto" else "cuda"))
    return machine


def run_mode(greedy: bool, args: Any, prompts: list[Any], console: Any) -> dict[str, Any]:
    from rich.progress import Progress

    settings = {"temperature": 0.0 if greedy else 1.0, "top_k": None, "top_p": 1.0,
                "max_new_tokens": args.max_new_tokens}
    configs = (chat_configs_for if args.chat else configs_for)(args.quick, greedy, args.k)
    if args.configs:
        wanted = set(args.configs)
        configs = [c for c in configs if c.name in wanted or c.name.startswith("plain")]
    prophet = bench_prophet(args.target, args.prophet)
    if not is_model_dir(prophet):  # assisted generation needs a draft model
        configs = [c for c in configs if c.kind != "hf-assisted"]
    configs += getattr(args, "peer_configs", [])
    from specdec.wiring import resolve_dtype

    runner = load_runner(configs, settings, args.target, prophet, resolve_dtype(getattr(args, "dtype", "default")),
                         getattr(args, "device", "cpu"))
    plain = runner.decoders["plain"]
    tok = plain.tokenizer
    # keep the end of a prompt that would not leave room for the continuation
    room = plain.target.max_length - args.max_new_tokens - 1
    if args.chat:
        prompt_ids = [plain.chat_ids(p.messages())[-room:] for p in prompts]
    else:
        prompt_ids = [list(tok(p.text)["input_ids"])[-room:] for p in prompts]
    runner = attach_peers(runner, configs, args.target or default_target(), prompt_ids, args.max_new_tokens,
                          plain.eos_token_ids)
    # warm-up: every configuration once on the first prompt, not recorded
    for cfg in configs:
        runner.run(cfg, prompt_ids[0], seed=0)
    ours = [c for c in configs if c.kind == "ours" and runner.decoders[c.name].prophets]
    main = next((c for c in ours if c.name.startswith(("prophet K=", "eagle K="))), ours[0] if ours else configs[0])
    first = runner.decoders[main.name].prophets[0] if main in ours else None
    prophet_lm = getattr(first, "lm", None)  # a model prophet's own model: its c measured apart
    costs = measure_costs(plain.target, prophet_lm, prompt_ids[0], ks=[1, 2, 3, 4, 6, 8])  # type: ignore[arg-type]
    tag = "greedy" if greedy else "sampling"
    total = len(configs) * len(prompts) * args.repeats
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(f"bench ({tag})", total=total)
        runs = interleaved(runner, configs, prompts, prompt_ids, args.repeats,
                           on_run=lambda r: bar.update(task, advance=1))
    # a peer's greedy tokens need not equal plain's (other kernels): its speedup is not withheld for it
    rows = [summarize_config(runs, cfg, "plain", greedy and cfg.kind != "peer", costs) for cfg in configs]
    categories = list(CHAT_CATEGORIES if args.chat else CATEGORIES)
    cats = by_category(runs, [c for c in configs if c.kind != "peer"], "plain", greedy, categories)
    cats.update(by_category(runs, [c for c in configs if c.kind == "peer"], "plain", False, categories))
    out_dir = Path(args.out)
    pics = plots(rows, cats, categories, runs, main.name, out_dir, tag)
    # one generation of the main configuration, as a timeline
    if main.kind == "ours":
        from specdec.viz import plot_timeline

        gen = runner.decoders[main.name].generate(prompt_ids[0], seed=0, **settings)
        pics.append(plot_timeline(gen.events, out_dir / f"timeline-{tag}.png", tokenizer=tok,
                                  title=f"{main.name}, {tag}: one generation"))
    peers = ({"peers": peer_summary(runs, configs, rows, greedy, peer_info(runner))}
             if any(c.kind == "peer" for c in configs) else {})
    return {"mode": tag, "settings": settings, "target_weights": plain.weights_detail, "costs": costs, "rows": rows,
            "roofline": _roofline(runner, configs),
            "by_category": cats, **peers,
            "plots": [Path(p).name for p in pics],  # beside bench.json
            "runs": [{"config": r.config, "prompt": r.prompt, "category": r.category, "tokens": len(r.tokens),
                      "wall_s": r.wall_s} for r in runs]}


def _check_config_names(args: Any) -> None:
    """--configs names what this suite runs (in either mode); a name it does not run is an error,
    not a configuration silently left out."""
    if not args.configs:
        return
    table = chat_configs_for if args.chat else configs_for
    known = {c.name for greedy in (True, False) for c in table(args.quick, greedy, args.k)}
    unknown = [name for name in args.configs if name not in known]
    if unknown:
        suite = "chat (the SmolLM2 target)" if args.chat else "code (the bundled pair)"
        quick = " --quick" if args.quick else ""
        raise SpecdecError(f"--configs: {', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not "
                           f"a configuration of the {suite} suite"
                           f"{quick}; its configurations: {', '.join(map(repr, sorted(known)))}")


def _first_speculative(runner: Runner, configs: list[Config]) -> Any:
    """The first of specdec's configurations' decoders that drafts, or None."""
    ours = [runner.decoders[c.name] for c in configs if c.kind == "ours" and c.name in runner.decoders]
    return next((d for d in ours if d.prophets), None)


def _roofline(runner: Runner, configs: list[Config]) -> dict[str, Any]:
    """The roofline of the first speculative configuration's decoder (its target and
    prophets), else of plain decoding's (`specdec.bench.roofline`)."""
    return roofline(_first_speculative(runner, configs) or runner.decoders["plain"])


def _cost_curve(runner: Runner, configs: list[Config]) -> dict[str, Any] | None:
    """The first speculative configuration's step costs as this machine measured them (its
    decoder's stored costs): a one-token step in ms and tokens scored in one pass -> one-token
    steps, greedy and at temperature 1; None where no configuration drafts."""
    decoder = _first_speculative(runner, configs)
    if decoder is None:
        return None
    costs = decoder.decision_costs()
    curve = {}
    for label, c in (("greedy", costs), ("temperature 1", costs.sampled)):
        if c is not None:
            curve[label] = {"step_ms": c.t_plain * 1e3,
                            "steps": {str(n): t / c.t_plain for n, t in sorted(c.t_verify.items())}}
    return {"kernel": getattr(decoder.target, "int4_kernel", None), "curves": curve}


def cost_curve_line(curve: dict[str, Any]) -> str:
    """The cost curve (`_cost_curve`) as one line of the report."""
    kernel = f" (4-bit kernel {curve['kernel']})" if curve.get("kernel") else ""
    parts = [f"{label}: a step {c['step_ms']:.2f} ms, " + ", ".join(f"{n}: {v:.2f}" for n, v in c["steps"].items())
             for label, c in curve["curves"].items()]
    return f"Cost curve, tokens scored in one pass -> one-token steps, as this machine measured them{kernel}: " \
        + "; ".join(parts) + "."


def run_bench(args: Any) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    if getattr(args, "suite", None) == "spec-bench":
        return run_specbench(args)
    if getattr(args, "suite", None) == "structured":
        from specdec.bench.structured import run_structured

        return run_structured(args)
    for flag, attr in (("--questions", "questions"), ("--per-task", "per_task"), ("--draft", "draft"),
                       ("--branches", "branches")):
        if getattr(args, attr, None) is not None:
            raise SpecdecError(f"{flag} goes with --suite spec-bench (the other suites choose prophets with "
                               "--configs and --prophet)")
    args.peer_configs = check_peers(getattr(args, "peers", None), args.target or default_target())
    args.chat = args.suite == "chat" or (args.suite == "auto" and is_alias(args.target or default_target()))
    _check_config_names(args)
    console = Console(stderr=True)
    torch.manual_seed(0)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    per_category = args.per_category or (2 if args.quick else 6)
    prompts: list[Any] = chat_prompts(per_category, heldout=True) if args.chat else build_suite(per_category)
    args.max_new_tokens = args.max_new_tokens or (64 if args.quick else 128)
    t0, load = time.perf_counter(), OtherLoad()
    modes = [m for m in args.modes.split(",") if m]
    results = [run_mode(m == "greedy", args, prompts, console) for m in modes]
    machine = _machine(args, load)
    device = getattr(args, "device", "cpu")
    lines = [res.pop("roofline") for res in results]  # the same decoders each mode: the last one's
    line = lines[-1] if lines else None
    report = {"roofline": line, "command": args.command_line, "machine": machine, "quick": args.quick, "device": device,
              "target_dtype": results[0]["target_weights"] if results else getattr(args, "dtype", "default"),
              "prompts": [{"category": p.category, "source": p.source} for p in prompts],
              "repeats": args.repeats, "wall_s": time.perf_counter() - t0, "results": results}
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1))
    md = [f"Command: `{args.command_line}`  \nMachine: {machine_line(machine)}; {len(prompts)} held-out prompts, "
          f"{args.max_new_tokens} new tokens, {args.repeats} repeat(s); target weights {report['target_dtype']}.\n"]
    if line is not None:
        md.append(roofline_line(line) + "\n")
    for res in results:
        c = res["costs"]
        header = (f"### {res['mode']}\n\nc = t_draft/t_target = {c.get('c', float('nan')):.3f}; verification cost "
                  f"t_target(K+1)/t_target(1) for K=4: {c['v_4']:.2f}; t_target(1) = {1e3 * c['t_target_1']:.1f} ms")
        md.append(markdown(res["rows"], res["by_category"], list(CHAT_CATEGORIES if args.chat else CATEGORIES),
                           header))
        if "peers" in res:
            md.append(peers_markdown(res["peers"], res["target_weights"]))
        table = Table(title=f"specdec bench ({res['mode']})")
        for key in ["config", "speedup", "min-max", "tok/s", "accept", "alpha", "tok/round", "c", "v", "pred",
                    "meas/pred", "other", "same"]:
            table.add_column(key)
        for r in res["rows"]:
            table.add_row(r["config"], _f(r.get("speedup")), f"{_f(r.get('speedup_min'))}-{_f(r.get('speedup_max'))}",
                          _f(r.get("tokens_per_s"), ".1f"), _f(r.get("acceptance_rate"), ".3f"),
                          _f(r.get("alpha"), ".3f"), _f(r.get("tokens_per_round")), _f(r.get("c"), ".3f"),
                          _f(r.get("verify_cost")), _f(r.get("predicted_speedup")),
                          _f(r.get("measured_over_predicted")), _f(r.get("other_fraction"), ".1%"),
                          _f(r.get("identical_to_plain")))
        console.print(table)
        for note in nothing_drafted(res["rows"]):
            console.print(note, markup=False)
        if "peers" in res:
            console.print(peers_markdown(res["peers"], res["target_weights"]), markup=False)
    (out_dir / "bench.md").write_text("\n".join(md))
    bf16 = "computes bf16 natively" if report["machine"]["native_bf16"] else "no native bf16 (fp32 prophets)"
    console.print(f"machine: {report['machine']['cpu']}, {bf16}")
    console.print(f"wrote bench.json, bench.md and plots to {out_dir} in {time.perf_counter() - t0:.0f}s")
    return report


# Spec-Bench (Xia et al. 2024, github.com/hemingkx/Spec-Bench): its eight MT-bench categories
# are one task, "mt_bench"; its other tasks are categories of their own.
SPEC_BENCH_MT = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def specbench_questions(path: str | None, per_task: int) -> list[BenchPrompt]:
    """The first user turns of a Spec-Bench question file (one {"question_id", "category",
    "turns"} object per line), `per_task` of each task (0: all): in file order, the MT-bench
    categories taken in turn so that a few questions still span them. Bad input is a
    SpecdecError of one line, raised before any model loads."""
    if not path:
        raise SpecdecError("--suite spec-bench needs --questions FILE (Spec-Bench's question.jsonl: one "
                           '{"question_id", "category", "turns"} object per line)')
    if per_task < 0:
        raise SpecdecError(f"--per-task must be 0 (all) or more, not {per_task}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise SpecdecError(f"--questions {path}: cannot read it ({why})") from None
    by_cat: dict[str, list[BenchPrompt]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"--questions {path} line {n}: not JSON ({e.msg})") from None
        if not isinstance(q, dict) or not isinstance(q.get("category"), str) or not q["category"]:
            raise SpecdecError(f'--questions {path} line {n}: not an object with a "category" string')
        turns = q.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise SpecdecError(f'--questions {path} line {n}: "turns" is not a list that starts with a user turn')
        cat = q["category"]
        by_cat.setdefault(cat, []).append(BenchPrompt(category="mt_bench" if cat in SPEC_BENCH_MT else cat,
                                                      source=f"{cat}:{q.get('question_id', n)}", text=turns[0]))
    if not by_cat:
        raise SpecdecError(f"--questions {path}: no questions in it")
    by_task: dict[str, list[list[BenchPrompt]]] = {}
    for qs in by_cat.values():
        by_task.setdefault(qs[0].category, []).append(qs)
    order = [t for t in SPEC_BENCH_TASKS if t in by_task] + [t for t in by_task if t not in SPEC_BENCH_TASKS]
    chosen: list[BenchPrompt] = []
    for task in order:
        lists = by_task[task]
        in_turn = [qs[i] for i in range(max(map(len, lists))) for qs in lists if i < len(qs)]
        chosen += in_turn[:per_task] if per_task else in_turn
    return chosen


def specbench_configs(target: str, drafts: list[str], branches: Sequence[int] = (1,)) -> list[Config]:
    """Plain decoding twice (the second run of the same configuration is the noise) and, for
    every --draft, the decoder specdec.load(target, draft) gives with its own defaults
    (auto policy, the target's K, auto multi): "default" is the target's shipped prophets;
    each once per --branches value (1: chains)."""
    out = [Config("plain", "ours"), Config("plain (again)", "ours")]
    for spec in drafts:
        name = f"default ({display_name(default_prophet_for(target))})" if spec == "default" else display_name(spec)
        for n in branches:
            out.append(Config(name if n == 1 else f"{name}, branches {n}", "ours", spec, "auto", k=0, multi="auto",
                              as_given=True, branches=n))
    return out


def parse_branches(text: str | None) -> list[int]:
    """--branches for spec-bench: a comma list of integers 1..MAX_BRANCHES (default "1")."""
    from specdec.api import check_branches
    from specdec.defaults import MAX_BRANCHES

    try:
        return [check_branches(int(v)) for v in (text or "1").split(",")]
    except ValueError:
        raise SpecdecError(f"--branches takes a comma list of integers from 1 to {MAX_BRANCHES}, "
                           f"not {text!r}") from None


def _specbench_result(mode: str, settings: dict[str, Any], configs: list[Config], runs: list[Run], tasks: list[str],
                      sources: list[str], peers: dict[str, Any] | None = None) -> dict[str, Any]:
    greedy = mode == "greedy"
    # a peer's greedy tokens need not equal plain's (other kernels): its speedup is not withheld for it
    ours, others = [c for c in configs if c.kind != "peer"], [c for c in configs if c.kind == "peer"]
    rows = [summarize_config(runs, cfg, "plain", greedy and cfg.kind != "peer", {}) for cfg in configs]
    extra = {"peers": peer_summary(runs, configs, rows, greedy, peers or {})} if others else {}
    return {"mode": mode, "settings": dict(settings),
            "tasks": by_task(runs, ours, "plain", greedy, tasks, sources)
            + by_task(runs, others, "plain", False, tasks, sources),
            "rows": rows, **extra,
            "runs": [{"config": r.config, "question": sources[r.prompt], "task": r.category, "tokens": len(r.tokens),
                      "wall_s": r.wall_s, "first_token_s": r.stats.get("first_token_s"),
                      "target_calls": r.stats.get("target_calls"),
                      "drafted": r.stats.get("drafted"), "accepted": r.stats.get("accepted")} for r in runs]}


def run_specbench(args: Any) -> dict[str, Any]:
    """`specdec bench --suite spec-bench`: each question's first turn (in the chat template
    where the target has one) decoded plainly and speculatively, interleaved in a rotating
    order, the same seed for each; per task and overall Spec-Bench's figures (report.by_task),
    plus the bench's usual per-configuration rows."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    per_task = 5 if args.per_task is None else args.per_task
    prompts = specbench_questions(args.questions, per_task)  # bad input fails here, before any model loads
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in ("greedy", "sampling") for m in modes):
        raise SpecdecError(f"--modes: greedy, sampling or both (greedy,sampling), not {args.modes!r}")
    peer_configs = check_peers(getattr(args, "peers", None), args.target or default_target())
    branches = parse_branches(getattr(args, "branches", None))
    console = Console(stderr=True)
    torch.manual_seed(0)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0, load = time.perf_counter(), OtherLoad()
    target = args.target or default_target()
    args.max_new_tokens = args.max_new_tokens or (64 if args.quick else 128)
    configs = specbench_configs(target, args.draft or ["default"], branches) + peer_configs
    from specdec.wiring import resolve_dtype

    runner = load_runner(configs, {}, target, bench_prophet(target, args.prophet),
                         resolve_dtype(getattr(args, "dtype", "default")), getattr(args, "device", "cpu"))
    plain = runner.decoders["plain"]
    chat = bool(getattr(plain.tokenizer, "chat_template", None))
    room = plain.target.max_length - args.max_new_tokens - 1
    full = [plain.chat_ids([{"role": "user", "content": p.text}]) if chat
            else list(plain.tokenizer(p.text)["input_ids"]) for p in prompts]
    cut = sum(len(ids) > room for ids in full)
    prompt_ids = [ids[-room:] for ids in full]  # keep the end of a prompt that would leave no room
    runner = attach_peers(runner, configs, target, prompt_ids, args.max_new_tokens, plain.eos_token_ids)
    tasks = list(dict.fromkeys(p.category for p in prompts))
    sources = [p.source for p in prompts]
    results = []
    with Progress(console=console, transient=True) as bar:
        job = bar.add_task("spec-bench", total=len(modes) * len(configs) * len(prompts) * args.repeats)
        for mode in modes:
            greedy = mode == "greedy"
            runner.settings = {"temperature": 0.0 if greedy else 1.0, "top_k": None, "top_p": 1.0,
                               "max_new_tokens": args.max_new_tokens}
            for cfg in configs:  # warm-up: every configuration once on the first question, not recorded
                runner.run(cfg, prompt_ids[0], seed=0)
            runs = interleaved(runner, configs, prompts, prompt_ids, args.repeats,
                               on_run=lambda r: bar.update(job, advance=1))
            results.append(_specbench_result(mode, runner.settings, configs, runs, tasks, sources, peer_info(runner)))
    machine = _machine(args, load)
    line = _roofline(runner, configs)
    curve = _cost_curve(runner, configs)
    reference = [{"method": m, "tokens_per_pass": v} for m, v in SPEC_BENCH_LEADERBOARD]
    report = {"command": args.command_line, "suite": "spec-bench", "machine": machine, "target": display_name(target),
              "device": getattr(args, "device", "cpu"), "target_dtype": plain.weights_detail,
              "questions_file": display_name(str(args.questions)), "per_task": per_task,
              "prompt_format": "chat template" if chat else "raw text (the target has no chat template)",
              "prompts_cut": cut, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "prompts": [{"task": p.category, "source": p.source} for p in prompts],
              "leaderboard_tokens_per_pass": reference, "roofline": line, "cost_curve": curve,
              "wall_s": time.perf_counter() - t0,
              "results": results}
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1))
    counts = ", ".join(f"{t} {sum(p.category == t for p in prompts)}" for t in tasks)
    md = [f"Command: `{args.command_line}`  \nMachine: {machine_line(machine)}; Spec-Bench: {len(prompts)} "
          f"questions ({counts}), first turns in {report['prompt_format']}"
          + (f" ({cut} cut to their last {room} tokens)" if cut else "")
          + f", {args.max_new_tokens} new tokens, {args.repeats} repeat(s); target {display_name(target)}, weights "
          f"{report['target_dtype']}; plain and speculative decoding interleaved per question, same seed.\n",
          "Speedup: throughput over plain decoding's (summed new tokens / summed seconds, Spec-Bench's "
          "definition; in greedy mode the ratio of summed times), with the min-max of the per-question ratios. "
          "Tokens per target pass: new tokens / target forward calls (1.00 for plain decoding).\n",
          "Spec-Bench leaderboard, tokens per target pass (Vicuna-7B-v1.3, greedy, fp16, one GPU): "
          + ", ".join(f"{m} {v:.2f}" for m, v in SPEC_BENCH_LEADERBOARD)
          + ". Tokens per pass does not depend on the hardware; a speedup does, and theirs are of a 7B model "
          "on a GPU.\n", roofline_line(line) + "\n"]
    if curve:
        md.append(cost_curve_line(curve) + "\n")
    for res in results:
        md.append(specbench_markdown(res["tasks"], f"### {res['mode']}"))
        md.append(markdown(res["rows"], {}, [], "All questions, per configuration (the bench's usual figures):"))
        if "peers" in res:
            md.append(peers_markdown(res["peers"], plain.weights_detail))
        table = Table(title=f"specdec bench --suite spec-bench ({res['mode']})")
        for key in ["config", "task", "n", "speedup", "min-max", "decoding", "tok/pass", "accept", "same"]:
            table.add_column(key)
        for r in res["tasks"]:
            same = "-" if r["identical"] is None else f"{r['identical']}/{r['questions']}"
            table.add_row(r["config"], r["task"], str(r["questions"]), _f(r["speedup"]),
                          f"{_f(r['speedup_min'])}-{_f(r['speedup_max'])}", _f(r.get("decode_speedup")),
                          _f(r["tokens_per_pass"]),
                          _f(r["acceptance_rate"], ".3f"), same if not r["mismatches"] else f"[bold red]{same}[/]")
        console.print(table)
        for r in res["tasks"]:
            if r["task"] == "overall" and r["mismatches"]:
                console.print(f"[bold red]MISMATCH ({res['mode']}, {r['config']}): greedy speculative output differs "
                              f"from plain decoding on {len(r['mismatches'])} question(s): "
                              f"{', '.join(r['mismatches'])}; their speedups are withheld[/]")
        for note in nothing_drafted(res["rows"]):
            console.print(note, markup=False)
        if "peers" in res:
            console.print(peers_markdown(res["peers"], plain.weights_detail), markup=False)
    (out_dir / "bench.md").write_text("\n".join(md))
    console.print(f"machine: {machine_line(machine)}")
    console.print(f"wrote bench.json and bench.md to {out_dir} in {time.perf_counter() - t0:.0f}s")
    return report
