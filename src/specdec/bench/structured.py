"""`specdec bench --suite structured`: JSON schemas and tool calls (specdec/data/structured.json,
each with a chat instruction), greedy, four ways interleaved per item in a rotating order:

- "spec constrained": the target's default prophets, the grammar's forced tokens committed;
- "spec constrained, no forced": the same, every token from a target pass (the grammar prophet off);
- "plain constrained": plain decoding under the grammar (forced tokens committed);
- "plain unconstrained": plain decoding, no grammar (the instruction alone).

With `--peers llama.cpp`, a fifth way in the same rotation: "llama.cpp constrained",
llama-cpp-python on the GGUF file specdec loads, fed specdec's prompt token ids, greedy,
under llama.cpp's own grammar sampler with the GBNF grammar its JSON-schema converter
writes for the item (`peer_gbnf`: the schema; a tool call's schema inside the same
`<tool_call>` tags, or free text under "auto").

Reported: validity (the answer parses and validates against its schema with jsonschema; a
tool call names an offered function, the named one where one is named, and its arguments
validate), seconds and speedups over the same items, tokens per target pass, forced
tokens, and the grammar's mask time per round and as a share of the wall time.
"""

from __future__ import annotations

import json
import re
import time
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch

from specdec.bench.peers import STRUCTURED_PEER_CONFIGS, Peer, check_peers, load_peer, peer_model_path
from specdec.bench.report import fmt
from specdec.bench.runner import Config
from specdec.defaults import cpu_model, default_target, display_name
from specdec.errors import SpecdecError
from specdec.tools import CLOSE, OPEN, call_schema, check_tools, read_calls, tool_grammar, with_tools

CONFIGS = ("spec constrained", "spec constrained, no forced", "plain constrained", "plain unconstrained")


def load_suite() -> dict[str, Any]:
    """The suite: {"schemas": [{id, shape, name, instruction, schema}], "tools": [...],
    "tool_calls": [{id, instruction, tool_choice}]}."""
    return dict(json.loads(files("specdec.data").joinpath("structured.json").read_text()))


def items(suite: dict[str, Any], n_schemas: int | None, n_tools: int | None) -> list[dict[str, Any]]:
    """The suite's requests: messages, the constraint's keywords, and how to check an answer."""
    out = []
    for s in suite["schemas"][:n_schemas]:
        out.append({"kind": "schema", "name": s["name"], "shape": s["shape"], "schema": s["schema"],
                    "messages": [{"role": "user", "content": s["instruction"] + " Answer with JSON only."}],
                    "constraint": {"response_format": {"type": "json_schema",
                                                       "json_schema": {"name": s["name"], "schema": s["schema"]}}}})
    for c in suite["tool_calls"][:n_tools]:
        functions, choice = check_tools(suite["tools"], c["tool_choice"])
        grammar = tool_grammar(functions, choice)
        assert grammar is not None
        chosen = functions if choice in ("auto", "required") else [f for f in functions if f["name"] == choice]
        out.append({"kind": "tool", "name": f"tool {c['id']} ({choice})", "shape": "tool call", "choice": choice,
                    "functions": functions, "call_schema": call_schema(chosen),
                    "messages": with_tools([{"role": "user", "content": c["instruction"]}], functions),
                    "constraint": {"grammar": grammar.source}})
    return out


def peer_gbnf(item: dict[str, Any]) -> str:
    """The item's constraint for llama.cpp: the GBNF grammar llama-cpp-python's JSON-schema
    converter writes for its schema (its own JSON layout); a tool call's schema (without
    specdec's layout) between the same tags, or under "auto" free text not starting with "<"
    as the alternative, as `tools.tool_grammar` allows."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    if item["kind"] == "schema":
        return str(json_schema_to_gbnf(json.dumps(item["schema"])))
    schema = {k: v for k, v in item["call_schema"].items() if k != "x-guidance"}
    rules = re.sub(r"^root ::=", "tool-call-json ::=", str(json_schema_to_gbnf(json.dumps(schema))), count=1,
                   flags=re.M)
    call = f'"{OPEN}" tool-call-json "{CLOSE}"'
    root = f'root ::= {call} | [^<] .*' if item["choice"] == "auto" else f"root ::= {call}"
    return root + "\n" + rules


def valid(item: dict[str, Any], text: str) -> bool:
    import jsonschema

    if item["kind"] == "schema":
        try:
            jsonschema.validate(json.loads(text), item["schema"])
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    calls = read_calls(text)
    if item["choice"] == "auto" and calls is None:
        return bool(text) and not text.startswith("<")  # an answer in words is valid under auto
    if not calls:
        return False
    f = calls[0]["function"]
    params = {g["name"]: g["parameters"] for g in item["functions"]}
    if f["name"] not in params or item["choice"] not in ("auto", "required", f["name"]):
        return False
    try:
        jsonschema.validate(json.loads(f["arguments"]), params[f["name"]])
    except jsonschema.ValidationError:
        return False
    return True


def run_peer(decoder: Any, peer: Peer, config: str, item: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    """The item through a peer: specdec's prompt token ids (the same chat template), greedy,
    under the peer's own grammar (`peer_gbnf`); its answer read with specdec's tokenizer. An
    item whose grammar the peer cannot take (item["peer_errors"][config]) is not run: invalid,
    its reason kept, left out of the seconds and tokens."""
    head = {"config": config, "item": item["name"], "kind": item["kind"], "shape": item["shape"], "forced": 0,
            "mask_s": None}
    error = item.get("peer_errors", {}).get(config)
    if error:
        return {**head, "valid": False, "not_run": error, "wall_s": 0.0, "new_tokens": 0, "target_calls": 0,
                "rounds": 0, "accepted": 0, "finish_reason": None, "token_ids": []}
    eos = set(decoder.eos_token_ids)
    settings = {"temperature": 0.0, "top_k": None, "top_p": 1.0, "max_new_tokens": max_new_tokens,
                "gbnf": item["gbnf"]}
    ids, wall, stats = peer.generate(decoder.chat_ids(item["messages"]), 0, settings)
    text = str(decoder.tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=True))
    return {**head, "valid": valid(item, text), "wall_s": wall, "new_tokens": len(ids),
            "target_calls": stats["target_calls"], "rounds": stats["target_calls"], "accepted": stats["accepted"],
            "finish_reason": "stop" if ids and ids[-1] in eos else "length", "token_ids": ids}


def run_one(decoders: dict[str, Any], config: str, item: dict[str, Any], max_new_tokens: int,
            peers: dict[str, Peer] | None = None) -> dict[str, Any]:
    if peers and config in peers:
        return run_peer(decoders["plain"], peers[config], config, item, max_new_tokens)
    decoder = decoders["spec" if config.startswith("spec") else "plain"]
    constraint = {} if config == "plain unconstrained" else item["constraint"]
    req, finish = decoder.request(messages=item["messages"], max_new_tokens=max_new_tokens, temperature=0.0,
                                  **constraint)
    if req.constraint is not None:
        req.constraint.jump = config != "spec constrained, no forced"
    t0 = time.perf_counter()
    g = decoder.run(req, finish)
    wall = time.perf_counter() - t0
    return {"config": config, "item": item["name"], "kind": item["kind"], "shape": item["shape"],
            "valid": valid(item, g.text), "wall_s": wall, "new_tokens": g.stats.new_tokens,
            "target_calls": g.stats.target_calls, "rounds": g.stats.rounds, "forced": g.stats.forced,
            "accepted": g.stats.accepted, "mask_s": req.constraint.mask_s if req.constraint is not None else 0.0,
            "finish_reason": g.finish_reason, "token_ids": g.token_ids}


def summarize_runs(runs: list[dict[str, Any]], configs: tuple[str, ...] = CONFIGS) -> list[dict[str, Any]]:
    """One row per configuration: validity, seconds, speedup over plain constrained (summed
    seconds over the same items: a peer's items not run left out of both), tokens per target
    pass, forced tokens, mask time."""
    rows = []
    for config in configs:
        every = [r for r in runs if r["config"] == config]
        if not every:
            continue
        mine = [r for r in every if not r.get("not_run")]
        ran = {r["item"] for r in mine}
        base = sum(r["wall_s"] for r in runs if r["config"] == "plain constrained" and r["item"] in ran)
        wall = sum(r["wall_s"] for r in mine)
        tokens = sum(r["new_tokens"] for r in mine)
        calls = sum(r["target_calls"] for r in mine)
        rounds = sum(r["rounds"] for r in mine)
        masks = [r["mask_s"] for r in mine if r["mask_s"] is not None]
        mask = sum(masks) if masks else None  # None: a peer, whose grammar time is not told apart
        rows.append({"config": config, "items": len(every), "not_run": len(every) - len(mine),
                     "valid": sum(r["valid"] for r in mine),
                     "wall_s": wall, "new_tokens": tokens, "tokens_per_s": tokens / wall if wall else 0.0,
                     "speedup_vs_plain_constrained": base / wall if wall else 0.0,
                     "tokens_per_pass": tokens / calls if calls else 0.0, "forced": sum(r["forced"] for r in mine),
                     "accepted": sum(r["accepted"] for r in mine),
                     "mask_ms_per_round": None if mask is None else 1e3 * mask / rounds if rounds else 0.0,
                     "mask_share": None if mask is None else mask / wall if wall else 0.0})
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = ("| configuration | valid | seconds | speedup vs plain constrained | tokens/s | tokens/pass | forced | "
            "accepted | mask ms/round | mask share |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {r['config']} | {r['valid']}/{r['items']} | {r['wall_s']:.1f} | "
             f"{r['speedup_vs_plain_constrained']:.2f}x | {r['tokens_per_s']:.1f} | {r['tokens_per_pass']:.2f} | "
             f"{r['forced']} | {r['accepted']} | {fmt(r['mask_ms_per_round'], '.3f')} | "
             f"{fmt(r['mask_share'], '.1%')} |" for r in rows]
    return "\n".join([head, *lines])


def load_peers(configs: list[Config], target: str, decoder: Any, work: list[dict[str, Any]],
               max_new_tokens: int) -> dict[str, Peer]:
    """The peers of `configs` on the target's GGUF file, a context just large enough for the
    longest prompt and its answer, torch's thread count; each item gets its GBNF grammar."""
    if not configs:
        return {}
    for item in work:
        item["gbnf"] = peer_gbnf(item)
    need = max(len(decoder.chat_ids(item["messages"])) for item in work) + max_new_tokens + 1
    path = peer_model_path(target)
    peers = {cfg.name: load_peer(cfg, path, -(-need // 256) * 256, torch.get_num_threads(),
                                 set(decoder.eos_token_ids)) for cfg in configs}
    for item in work:
        item["peer_errors"] = {name: check(item["gbnf"]) for name, p in peers.items()
                               if (check := getattr(p, "grammar_error", None)) is not None}
    return peers


def run_structured(args: Any) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import Progress

    import specdec

    try:
        import jsonschema  # noqa: F401
    except ImportError:
        raise SpecdecError('--suite structured checks answers with jsonschema: pip install -e ".[bench]"') from None
    target = args.target or default_target()
    peer_configs = check_peers(getattr(args, "peers", None), target, STRUCTURED_PEER_CONFIGS)
    console = Console(stderr=True)
    suite = load_suite()
    n_schemas, n_tools = (10, 4) if args.quick else (None, None)
    if args.per_category is not None:
        n_schemas = args.per_category
    work = items(suite, n_schemas, n_tools)
    max_new_tokens = args.max_new_tokens or 160
    t0 = time.perf_counter()
    spec = specdec.load(target, device=getattr(args, "device", "cpu"))
    decoders = {"spec": spec, "plain": spec.plain()}
    peers = load_peers(peer_configs, target, spec, work, max_new_tokens)
    configs = CONFIGS + tuple(peers)
    for config in configs:  # warm-up: every configuration once, not recorded
        run_one(decoders, config, work[0], 16, peers)
    runs = []
    with Progress(console=console, transient=True) as bar:
        job = bar.add_task("structured", total=len(work) * len(configs) * args.repeats)
        for rep in range(args.repeats):
            for i, item in enumerate(work):
                shift = (i + rep) % len(configs)
                for config in configs[shift:] + configs[:shift]:
                    runs.append(run_one(decoders, config, item, max_new_tokens, peers))
                    bar.update(job, advance=1)
    same = [item["name"] for item in work
            if len({tuple(r["token_ids"]) for r in runs if r["item"] == item["name"] and
                    r["config"] in CONFIGS[:3]}) > 1]
    rows = summarize_runs(runs, configs)
    machine = cpu_model()
    report = {"command": getattr(args, "command_line", "specdec bench --suite structured"), "suite": "structured",
              "machine": machine, "target": display_name(target), "prophets": [p.name for p in spec.prophets],
              "max_new_tokens": max_new_tokens, "schemas": sum(i["kind"] == "schema" for i in work),
              "tool_calls": sum(i["kind"] == "tool" for i in work), "repeats": args.repeats, "rows": rows,
              "peers": {name: getattr(p, "info", {}) for name, p in peers.items()},
              "greedy_mismatches": same, "wall_s": time.perf_counter() - t0,
              "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    md = report_markdown(report)
    (out / "bench.md").write_text(md)
    console.print(md, markup=False)
    return report


def report_markdown(report: dict[str, Any]) -> str:
    same = report["greedy_mismatches"]
    md = (f"Command: `{report['command']}`  \nMachine: {report['machine']}; target {report['target']} with "
          f"{' + '.join(report['prophets']) or 'no prophet'}; {report['schemas']} JSON schemas and "
          f"{report['tool_calls']} tool calls, greedy, at most {report['max_new_tokens']} new tokens, interleaved "
          "per item.\n\n" + markdown_table(report["rows"]) + "\n\n" +
          (f"Greedy outputs that differ between constrained configurations: {', '.join(same)}\n" if same else
           "Greedy constrained outputs identical across the three constrained configurations on every item.\n"))
    for name, info in report["peers"].items():
        md += (f"\n{name}: {info.get('package', '?')} on the same GGUF file {info.get('file', '?')}, "
               f"{info.get('threads', '?')} thread(s), fed specdec's prompt token ids, under llama.cpp's grammar "
               "sampler with the GBNF its JSON-schema converter writes (its own JSON layout, so its answers and "
               "token counts differ from specdec's); its grammar time is inside its seconds.\n")
        skipped = sorted({r["item"] for r in report["runs"] if r["config"] == name and r.get("not_run")})
        if skipped:
            reason = next(r["not_run"] for r in report["runs"] if r["config"] == name and r.get("not_run"))
            md += (f"{name}: {len(skipped)} item(s) not run, counted invalid ({reason}: its converter's GBNF for "
                   f"the schema): {', '.join(skipped)}.\n")
    return md
