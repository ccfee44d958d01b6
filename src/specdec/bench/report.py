"""Runs -> the figures of the report (per configuration and per category), the markdown
table and the plots."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from specdec.bench.runner import Config, Run, predicted_speedup
from specdec.defaults import display_name


def _pair_ratios(runs: list[Run], name: str, baseline: str, greedy: bool) -> tuple[list[float], list[int]]:
    """Per (prompt, repeat) speedup of `name` over `baseline`, time per token; and the prompt
    of every greedy run whose output differs from the baseline's (empty: all identical)."""
    # runs of one prompt are in repeat order, so the i-th of each side pair up
    base: dict[int, list[Run]] = defaultdict(list)
    mine: dict[int, list[Run]] = defaultdict(list)
    for r in runs:
        if r.config == baseline:
            base[r.prompt].append(r)
        if r.config == name:
            mine[r.prompt].append(r)
    ratios: list[float] = []
    mismatched: list[int] = []
    for key, rs in mine.items():
        for rep, r in enumerate(rs):
            b = base[key][rep]
            if greedy and r.tokens != b.tokens:
                mismatched.append(key)
            if r.tokens and b.tokens:
                ratios.append((b.wall_s / len(b.tokens)) / (r.wall_s / len(r.tokens)))
    return ratios, mismatched


def _v_for(costs: dict[str, float], k: float) -> float:
    """Verification cost ratio for a (possibly fractional) draft length, interpolated."""
    ks = sorted(int(key[2:]) for key in costs if key.startswith("v_"))
    if not ks:
        return 1.0
    k = min(max(k, ks[0]), ks[-1])
    lo = max(x for x in ks if x <= k)
    hi = min(x for x in ks if x >= k)
    if lo == hi:
        return costs[f"v_{lo}"]
    w = (k - lo) / (hi - lo)
    return (1 - w) * costs[f"v_{lo}"] + w * costs[f"v_{hi}"]


def summarize_config(runs: list[Run], cfg: Config, baseline: str, greedy: bool,
                     costs: dict[str, float]) -> dict[str, Any]:
    mine = [r for r in runs if r.config == cfg.name]
    ratios, mismatched = _pair_ratios(runs, cfg.name, baseline, greedy)
    identical = not mismatched
    tokens = sum(len(r.tokens) for r in mine)
    wall = sum(r.wall_s for r in mine)
    row: dict[str, Any] = {"config": cfg.name, "kind": cfg.kind, "draft": display_name(cfg.draft), "policy": cfg.policy,
                           "k": cfg.k, "tokens": tokens, "tokens_per_s": tokens / wall if wall else 0.0,
                           "identical_to_plain": identical if greedy else None}
    ok = identical or not greedy
    row["speedup"] = statistics.median(ratios) if ratios and ok else None
    row["speedup_min"] = min(ratios) if ratios and ok else None
    row["speedup_max"] = max(ratios) if ratios and ok else None
    stats = [r.stats for r in mine if r.stats]
    if not stats:
        return row
    if "rounds" not in stats[0]:  # another engine's runs (bench.peers): its passes and drafts only
        calls, drafted = sum(s.get("target_calls", 0) for s in stats), sum(s.get("drafted", 0) for s in stats)
        row.update(tokens_per_round=tokens / calls if calls else None, target_calls=calls / len(stats),
                   acceptance_rate=sum(s.get("accepted", 0) for s in stats) / drafted if drafted else None)
        return row
    rounds = sum(s["rounds"] for s in stats)
    drafted = sum(s["drafted"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    per_request = [s["acceptance_rate"] for s in stats if s["drafted"]]
    profiles = [s["acceptance_by_position"] for s in stats if s["acceptance_by_position"]]
    depth = max((len(p) for p in profiles), default=0)
    tested = accepted + sum(s["recovered"] for s in stats if s["drafted"])
    row.update(
        drafted=drafted,
        acceptance_rate=accepted / drafted if drafted else None,
        alpha=accepted / tested if tested else None,
        acceptance_rate_per_request=statistics.mean(per_request) if per_request else None,
        tokens_per_round=(accepted + rounds) / rounds,
        target_calls=sum(s["target_calls"] for s in stats) / len(stats),
        draft_calls=sum(s["draft_calls"] for s in stats) / len(stats),
        other_fraction=sum(s["other_s"] for s in stats) / sum(s["wall_s"] for s in stats),
        acceptance_by_position=[statistics.mean(p[i] for p in profiles if len(p) > i) for i in range(depth)],
    )
    if drafted and tested and "t_target_1" in costs:
        a = min(accepted / tested, 0.999)
        per_round = drafted / rounds
        draft_s = sum(s["draft_s"] for s in stats) / rounds
        row["c_round"] = draft_s / costs["t_target_1"]
        calls = sum(s["draft_calls"] for s in stats)
        if calls:  # one drafting step against one target step (c of the cost model), for every kind of prophet
            row["c"] = sum(s["draft_s"] for s in stats) / calls / costs["t_target_1"]
        row["verify_cost"] = _v_for(costs, per_round)
        row["predicted_speedup"] = predicted_speedup(a, per_round, draft_s, costs["t_target_1"], row["verify_cost"])
        if row["speedup"]:
            row["measured_over_predicted"] = row["speedup"] / row["predicted_speedup"]
    return row


def by_category(runs: list[Run], configs: list[Config], baseline: str, greedy: bool,
                categories: list[str]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for cfg in configs:
        out[cfg.name] = {}
        for cat in categories:
            sub = [r for r in runs if r.category == cat]
            ratios, mismatched = _pair_ratios(sub, cfg.name, baseline, greedy)
            out[cfg.name][cat] = statistics.median(ratios) if ratios and not mismatched else None
    return out


def fmt(x: Any, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return format(x, spec) if isinstance(x, float) else str(x)


COLUMNS = [("config", "config", "s"), ("speedup", "speedup (median)", ".2f"), ("spread", "min-max", "s"),
           ("tokens_per_s", "tok/s", ".1f"), ("acceptance_rate", "accept", ".3f"),
           ("acceptance_rate_per_request", "accept/req", ".3f"), ("alpha", "alpha", ".3f"),
           ("tokens_per_round", "tok/round", ".2f"), ("c", "c", ".3f"), ("verify_cost", "v", ".2f"),
           ("target_calls", "target calls", ".1f"), ("draft_calls", "draft calls", ".1f"),
           ("predicted_speedup", "predicted", ".2f"), ("measured_over_predicted", "meas/pred", ".2f"),
           ("other_fraction", "other time", ".1%"), ("identical_to_plain", "same tokens", "s")]


def nothing_drafted(rows: list[dict[str, Any]]) -> list[str]:
    """A line for each of specdec's configurations with prophets that drafted no token on the
    prompts (a lookup in contexts that never repeat, a policy whose K stayed 0): its figures are
    plain decoding's, and the report says so rather than show a speedup of about 1 as speculation's."""
    return [f"drafted 0 tokens: '{r['config']}' ({r['draft']}) proposed nothing on these prompts, so its figures "
            "are plain decoding's" for r in rows
            if r.get("kind") == "ours" and r.get("draft") not in (None, "none") and r.get("drafted") == 0]


def markdown(rows: list[dict[str, Any]], cats: dict[str, dict[str, float | None]], categories: list[str],
             header: str) -> str:
    lines = [header, "", "| " + " | ".join(c[1] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        r = dict(r, spread=f"{fmt(r.get('speedup_min'))}-{fmt(r.get('speedup_max'))}")
        lines.append("| " + " | ".join(fmt(r.get(key), spec) for key, _, spec in COLUMNS) + " |")
    if nothing_drafted(rows):
        lines += ["", *nothing_drafted(rows)]
    if not cats:
        return "\n".join(lines) + "\n"
    lines += ["", "Speedup over plain decoding by prompt category (median):", "",
              "| config | " + " | ".join(categories) + " |", "|" + "---|" * (len(categories) + 1)]
    for name, per in cats.items():
        lines.append(f"| {name} | " + " | ".join(fmt(per[c]) for c in categories) + " |")
    return "\n".join(lines) + "\n"


# Spec-Bench's leaderboard (github.com/hemingkx/Spec-Bench): mean tokens per target forward pass,
# Vicuna-7B-v1.3 unless named, greedy, fp16, one GPU. Tokens per pass does not depend on the hardware.
SPEC_BENCH_LEADERBOARD = [("EAGLE-3 (Vicuna-13B)", 5.71), ("EAGLE-2", 4.35), ("EAGLE", 3.57), ("Medusa", 2.31),
                          ("prompt lookup (PLD)", 1.73), ("Lookahead", 1.64)]


def _decode_rate(runs: list[Run]) -> float | None:
    """Tokens after the first over the seconds after the first token (prompt reading and the first
    round left out), summed over runs; None where a run has no first-token time (a peer)."""
    firsts = [r.stats.get("first_token_s") for r in runs]
    if not runs or any(f is None for f in firsts):
        return None
    tokens = sum(max(len(r.tokens) - 1, 0) for r in runs)
    seconds = sum(r.wall_s - float(f or 0.0) for r, f in zip(runs, firsts, strict=True))
    return tokens / seconds if tokens and seconds > 0 else None


def by_task(runs: list[Run], configs: list[Config], baseline: str, greedy: bool, tasks: list[str],
            sources: list[str]) -> list[dict[str, Any]]:
    """Spec-Bench's figures of every configuration but the baseline, per task and "overall":
    speedup = its throughput over the baseline's (summed new tokens / summed seconds, as
    Spec-Bench computes it; in greedy mode, where the outputs are identical, the ratio of
    summed times), the min-max of the per-question ratios, the decoding speedup (the same ratio
    of throughputs counted after each run's first token: sampled runs end at different lengths,
    and a short answer spends more of its time reading the prompt, which speculation does not
    touch), tokens per target pass (new tokens
    / target forward calls; 1.00 for plain decoding), acceptance (accepted / drafted) and, in
    greedy mode, how many questions gave the baseline's tokens exactly. A greedy mismatch
    withholds the speedup of its task and of "overall" and names the question."""
    rows = []
    for cfg in configs:
        if cfg.name == baseline:
            continue
        for task in [*tasks, "overall"]:
            sub = [r for r in runs if task == "overall" or r.category == task]
            mine = [r for r in sub if r.config == cfg.name]
            base = [r for r in sub if r.config == baseline]
            if not mine or not base:
                continue
            ratios, mismatched = _pair_ratios(sub, cfg.name, baseline, greedy)
            mismatches = [sources[p] for p in mismatched]
            tokens, wall = sum(len(r.tokens) for r in mine), sum(r.wall_s for r in mine)
            base_tokens, base_wall = sum(len(r.tokens) for r in base), sum(r.wall_s for r in base)
            calls = sum(r.stats.get("target_calls", 0) for r in mine)
            drafted = sum(r.stats.get("drafted", 0) for r in mine)
            accepted = sum(r.stats.get("accepted", 0) for r in mine)
            ok = not mismatches
            speedup = (tokens / wall) / (base_tokens / base_wall) if wall and base_wall and base_tokens else None
            decode, base_decode = _decode_rate(mine), _decode_rate(base)
            rows.append({"config": cfg.name, "draft": display_name(cfg.draft), "task": task, "questions": len(mine),
                         "tokens": tokens, "wall_s": wall, "plain_tokens": base_tokens, "plain_wall_s": base_wall,
                         "speedup": speedup if ok else None,
                         "speedup_min": min(ratios) if ratios and ok else None,
                         "speedup_max": max(ratios) if ratios and ok else None,
                         "tokens_per_pass": tokens / calls if calls else None,
                         "decode_speedup": decode / base_decode if decode and base_decode and ok else None,
                         "acceptance_rate": accepted / drafted if drafted else None,
                         "identical": len(mine) - len(mismatches) if greedy else None,
                         "identical_to_plain": ok if greedy else None, "mismatches": mismatches})
    return rows


SPEC_BENCH_COLUMNS = [("config", "config", "s"), ("task", "task", "s"), ("questions", "questions", "d"),
                      ("speedup", "speedup", ".2f"), ("spread", "per-question min-max", "s"),
                      ("decode_speedup", "decoding speedup (after the first token)", ".2f"),
                      ("tokens_per_pass", "tokens per target pass", ".2f"), ("acceptance_rate", "accept", ".3f"),
                      ("same", "same tokens", "s")]


def specbench_markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "", "| " + " | ".join(c[1] for c in SPEC_BENCH_COLUMNS) + " |",
             "|" + "---|" * len(SPEC_BENCH_COLUMNS)]
    for r in rows:
        same = "-" if r["identical"] is None else f"{r['identical']}/{r['questions']}"
        if r["mismatches"]:
            same += " **MISMATCH**"
        r = dict(r, spread=f"{fmt(r.get('speedup_min'))}-{fmt(r.get('speedup_max'))}", same=same,
                 task=f"**{r['task']}**" if r["task"] == "overall" else r["task"])
        lines.append("| " + " | ".join(fmt(r.get(key), spec) for key, _, spec in SPEC_BENCH_COLUMNS) + " |")
    bad = sorted({q for r in rows if r["task"] == "overall" for q in r["mismatches"]})
    if bad:
        lines += ["", f"**MISMATCH: greedy speculative output differs from plain decoding on {len(bad)} "
                      f"question(s): {', '.join(bad)}. Their speedups are withheld.**"]
    return "\n".join(lines) + "\n"


def plots(rows: list[dict[str, Any]], cats: dict[str, dict[str, float | None]], categories: list[str],
          runs: list[Run], main_config: str, out_dir: Path, tag: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    names = [n for n in cats if any(v is not None for v in cats[n].values())]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        vals = [cats[name][c] or 0.0 for c in categories]
        ax.bar([i + j * width for i in range(len(categories))], vals, width, label=name)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(categories))], categories)
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"speedup by prompt category ({tag})")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    paths.append(out_dir / f"speedup-{tag}.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    hist = [a for r in runs if r.config == main_config for a in r.stats.get("accepted_per_round", [])]
    if hist:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.hist(hist, bins=range(0, max(hist) + 2), align="left", rwidth=0.85, color="#52be80")
        ax.set_xlabel("accepted tokens per round")
        ax.set_ylabel("rounds")
        ax.set_title(f"{main_config} ({tag})")
        fig.tight_layout()
        paths.append(out_dir / f"accepted-hist-{tag}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
