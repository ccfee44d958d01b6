"""The `specdec` command line's arguments: one parser, its commands and their options (`specdec.cli`
runs them)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

from specdec.defaults import (
    KV_DTYPES,
    MAX_NEW_TOKENS,
    PREFILL_CHUNK,
    SAMPLING_RULE,
    SERVE_PREFIX_CACHE_MB,
    TEMPERATURE,
    TOP_P,
    TRAINED_PROPHET,
    TRAINED_TARGET,
)


def model_args(p: argparse.ArgumentParser) -> None:
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


def sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=TEMPERATURE,
                   help=f"0 = greedy (default {TEMPERATURE:g}; {SAMPLING_RULE})")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default: all)")
    p.add_argument("--top-p", type=float, default=TOP_P, help=f"nucleus sampling (default {TOP_P:g})")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--draft-tokens", "-k", type=int, default=None,
                   help="K, tokens drafted per round (auto policy: the most it may choose); default 4, or 8 for "
                        "smollm2's default prophets")


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (what is wrong and what the choices are), exit code 2,
    without the usage block: `specdec COMMAND --help` shows that."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(handlers: dict[str, Callable[[argparse.Namespace], int]]) -> argparse.ArgumentParser:
    """The `specdec` parser; handlers: the function that runs each command (`specdec.cli`)."""
    parser = Parser(prog="specdec", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, printing it as it is verified")
    g.add_argument("prompt", nargs="?", default=None)
    g.add_argument("--prompts-file", default=None,
                   help="many prompts, one per line (text, or JSON with its own settings), run as one batch")
    g.add_argument("--max-batch", type=int, default=16, help="rows decoded together with --prompts-file")
    model_args(g)
    sampling_args(g)
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
    g.set_defaults(func=handlers["generate"])

    ch = sub.add_parser("chat", help="a conversation in the terminal: a line on stdin per message, answers streamed")
    model_args(ch)
    sampling_args(ch)
    ch.add_argument("--sampling", default="rejection", metavar="{rejection,coupled}",
                    help="as for generate")
    ch.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"the most tokens an answer may have (default {MAX_NEW_TOKENS})")
    ch.add_argument("--system", default=None, help="a system message that starts the conversation")
    ch.add_argument("--prefix-cache", type=float, default=256.0, metavar="MIB",
                    help="MiB of the conversation's keys and values kept between turns, so each turn reads only "
                         "what is new, with the same answers (default 256; 0: none)")
    ch.set_defaults(func=handlers["chat"])

    c = sub.add_parser("check", help="statistical certificate that speculation leaves the distribution unchanged")
    model_args(c)
    sampling_args(c)
    c.add_argument("--prompt", default="import os\nimport sys\nimport ",
                   help="a prompt whose continuations repeat often enough to fill the test's cells")
    c.add_argument("--tokens", type=int, default=3,
                   help="length of each sampled continuation (at least 3 for a feature prophet to draft)")
    c.add_argument("--samples", type=int, default=600, help="continuations sampled each way")
    c.add_argument("--alpha", type=float, default=0.001, help="significance level")
    c.add_argument("--json", action="store_true", help="print one JSON document on stdout and nothing else")
    c.set_defaults(func=handlers["check"])

    cal = sub.add_parser("calibrate", help="the step costs K is chosen from on this machine: shown, or measured "
                                           "again with --again (stored once per machine and settings)")
    model_args(cal)
    cal.add_argument("--draft-tokens", "-k", type=int, default=None,
                     help="the largest K the costs are measured for (default: the target's default K)")
    cal.add_argument("--again", action="store_true", help="forget the stored costs and measure them again now")
    cal.add_argument("--json", action="store_true", help="print the key and costs as one JSON document")
    cal.set_defaults(func=handlers["calibrate"])

    t = sub.add_parser("train", help="train the tokenizer and the target on the stdlib corpus")
    t.add_argument("--config", default="configs/bundled.toml",
                   help="a config file (configs/NAME.toml: a shipped one, unless that path exists here)")
    t.add_argument("--work-dir", default=".cache/bundled")
    t.add_argument("--out", default=TRAINED_TARGET, help="where the target is written (under this directory)")
    t.add_argument("--corpus-root", default=None, help="corpus directory (default: this Python's stdlib)")
    t.add_argument("--minutes", type=float, default=None, help="override the config's training time")
    t.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke runs)")
    t.set_defaults(func=handlers["train"])

    d = sub.add_parser("distill", help="an eagle prophet for any lean-path model (--target X --minutes N), or a "
                                       "config's prophets (--config)")
    d.add_argument("--config", default=None,
                   help="a config file (configs/NAME.toml: a shipped one, unless that path exists here; default: "
                        "configs/bundled.toml, unless --minutes is given)")
    d.add_argument("--minutes", type=float, default=None,
                   help="no config: train an eagle prophet for --target (any Llama, Mistral, Qwen2/3, Gemma 2/3 or "
                        "Phi-3 model: directory, cached hub id or GGUF file) in this many minutes, from data the "
                        "target writes itself; resumable (run it again to go on), written where load(TARGET) finds it")
    d.add_argument("--work-dir", default=None, help="intermediate state (default: the config's, or .cache/bundled)")
    d.add_argument("--models-dir", default=None, help="where a real target's prophets are exported (config: models)")
    d.add_argument("--only", nargs="*", default=None, help="only these prophets (eagle, medusa, kangaroo)")
    d.add_argument("--target", default=None,
                   help=f"the target to distill from (with --minutes: required; else default {TRAINED_TARGET}, "
                   "`specdec train`'s, where it exists, else the shipped one)")
    d.add_argument("--out", default=None,
                   help=f"where the prophet is written (default: {TRAINED_PROPHET}; with --minutes the user cache, "
                        "keyed by the target's weights, where load(TARGET) finds it)")
    d.add_argument("--data-out", default=None, help="also save the data-only prophet here")
    d.add_argument("--data-minutes", type=float, default=None)
    d.add_argument("--distill-minutes", type=float, default=None)
    d.add_argument("--max-steps", type=int, default=None)
    d.add_argument("--prompts", type=int, default=None,
                   help="with --minutes: answer at most this many prompts (default: as many as the time allows)")
    d.add_argument("--batch-size", type=int, default=32, help="with --minutes: prompts answered together")
    d.add_argument("--max-new-tokens", type=int, default=256, help="with --minutes: the longest answer")
    d.add_argument("--check-samples", type=int, default=600,
                   help="with --minutes: `specdec check --samples` run on the result at the end (0: no check)")
    d.set_defaults(func=handlers["distill"])

    ix = sub.add_parser("index", help="build the retrieval datastore (suffix array over the training corpus)")
    ix.add_argument("--tokenizer", default=None,
                    help="tokenizer to index with: a model id, path, smollm2 or bundled (default: smollm2's)")
    ix.add_argument("--out", default=None, help="where to write it (default: the cache used by --draft retrieval)")
    ix.set_defaults(func=handlers["index"])

    sv = sub.add_parser("serve", help="OpenAI-compatible server: completions, chat, streaming, web view at /")
    model_args(sv)
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
    sv.set_defaults(func=handlers["serve"])

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
                        "lookup; with --suite structured, its own JSON-schema constrained decoding; "
                        'pip install -e ".[llamacpp]")')
    b.set_defaults(func=handlers["bench"])
    return parser
