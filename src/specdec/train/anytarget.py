"""`specdec distill --target X --minutes N`: an eagle prophet for any model on the lean path, no config file.

The target teaches itself; nothing from outside is read (Spec-Bench's questions never):
1. data: prompts, then the target's answers through the decoder users run
   (`specdec.load(X, draft="none").generate_many`, which runs every lean family exactly), at
   greedy, T=0.7 and T=1 in turn, one shard of ids per batch. A chat model's prompts are
   Magpie-style questions it writes itself (its chat template applied to an empty user turn,
   cut where the user's text would start, each question ending at the template's end-of-turn)
   and the task prompts of `specdec.data.tasks`; a base model's (no chat template) are openings
   of its own text, which it then continues.
2. features: each answered sequence read once by the same model's own pass
   (`BatchLlama.forward_features`, rows at a time): its last hidden state at every position,
   added to the shard (`specdec.train.features.load_shards` reads it).
3. training: an eagle head (`specdec.train.features.train_head`) over the target's own input
   embeddings and head, the very tensors the serving prophet reads (`wiring` hands a feature
   prophet `target.embeddings()` and `target.head()`), against the target's distribution
   (its final soft-cap applied, as the target's logits have it); the draft vocabulary chosen as
   the SmolLM2 pipeline chooses it; the held-out greedy agreement per draft step reported.
N minutes are split between the stages (`Budget`); every stage resumes where a stopped run
left it (work folder cache_dir()/distill/<key>), and the time spent is counted across runs.
The prophet goes where `specdec.load(X)` finds it by default: cache_dir()/prophets/<key>/eagle,
key = the hash of X's weights files (`specdec.defaults.weights_key`), or to --out.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.defaults import cache_dir, is_alias, prophets_dir, weights_files, weights_key
from specdec.errors import SpecdecError

Log = Callable[[str], None]

TEMPERATURES = (0.0, 0.7, 1.0)  # the answers' temperatures, batch after batch (as specdec.train.grow)
QUESTION_TOKENS = 96  # the longest Magpie question kept
OPENING_TOKENS = 48  # a base model's openings of its own text
SHARES = {"data": 0.6, "train": 0.4}  # of N minutes: data (answers, then their features) and training
QUESTION_SHARE = 0.2  # of the data share at most: drawing Magpie questions
UNROLL, DEPTH, BATCH = 4, 2, 256  # draft steps trained, residual blocks, positions a step (configs/smollm2.toml's)
EAGLE: dict[str, Any] = {"unroll": UNROLL, "depth": DEPTH, "lr": 1e-3, "batch_size": BATCH, "reg_weight": 0.1,
                         "seed": 0}
DRAFT_VOCAB = 8192  # the ids most frequent in the answers, as configs/smollm2.toml's [vocab]


@dataclass
class Settings:
    """What one run does besides its minutes (the CLI's options; small values in tests)."""

    prompts: int | None = None  # the most prompts answered (None: as many as the time allows)
    batch_size: int = 32  # prompts answered together: one shard
    max_new_tokens: int = 256
    max_steps: int | None = None  # training steps at most (smoke runs)
    seed: int = 0


@dataclass
class Budget:
    """N minutes split between the stages; `spent` (seconds per stage) is kept in the work
    folder's state.json, so a resumed run spends what is left."""

    minutes: float
    spent: dict[str, float]

    ratio: float | None = None  # reading a batch's features takes this many times its answering

    def share(self, stage: str) -> float:
        """Seconds for a stage: the data share split between answering and reading the answers'
        features by their measured ratio (`ratio`; until it is measured, answering has it all)."""
        data = self.minutes * 60 * SHARES["data"]
        if stage == "answers":
            return data / (1 + (self.ratio or 0.0))
        if stage == "features":
            return data - self.share("answers")
        return self.minutes * 60 * SHARES[stage]

    def left(self, stage: str) -> float:
        """Seconds a stage may still spend: its share less what it spent (across resumed runs)."""
        return max(0.0, self.share(stage) - self.spent.get(stage, 0.0))

    def total_left(self) -> float:
        return max(0.0, self.minutes * 60 - sum(self.spent.values()))

    def describe(self) -> str:
        m = {k: self.minutes * v for k, v in SHARES.items()}
        return (f"{self.minutes:g} min in all: data {m['data']:.1f} min (questions at most "
                f"{m['data'] * QUESTION_SHARE:.1f}, then answers and the features of every answer, split by their "
                f"cost measured on the first batch), training the rest (~{m['train']:.1f} min); then specdec check")


class Work:
    """The work folder of one target's run: its state, prompts, shards and checkpoint."""

    def __init__(self, root: Path) -> None:
        self.root = root
        path = root / "state.json"
        self.state: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"spent": {}, "done": []}

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        _write_json(self.root / "state.json", self.state)

    def done(self, stage: str) -> bool:
        return stage in self.state["done"]

    def finish(self, stage: str) -> None:
        if stage not in self.state["done"]:
            self.state["done"].append(stage)
        self.save()

    def spend(self, stage: str, seconds: float) -> None:
        self.state["spent"][stage] = self.state["spent"].get(stage, 0.0) + seconds
        self.save()

    def shards(self) -> list[Path]:
        return sorted(self.root.glob("shard-*.pt"))


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def _seed(*parts: object) -> int:
    return int(hashlib.sha256("-".join(map(str, parts)).encode()).hexdigest()[:8], 16)


def _ends(t0: float, seconds: float) -> str:
    return f"ends in ~{seconds / 60:.1f} min (at {time.strftime('%H:%M', time.localtime(t0 + seconds))})"


# ----------------------------------------------------------------------------- the target
def target_key(target: str) -> str:
    """The key of a target's weights (`specdec.defaults.weights_key`); a clear error where none is found."""
    if is_alias(target):
        from specdec.gguf import smollm2_gguf

        files = [smollm2_gguf()]
    else:
        files = weights_files(target)
    if not files:
        raise SpecdecError(f"--target '{target}': no weights files found (a model directory with .safetensors or "
                           "pytorch_model*.bin files, a .gguf file, or a Hugging Face id already in the local cache)")
    return weights_key(files)


def load_lean(target: str) -> Any:
    """The decoder users run for `target`, plain (`specdec.load(target, draft="none")`), on the lean path."""
    import specdec
    from specdec import families
    from specdec.llama import BatchLlama

    decoder = specdec.load(target, draft="none")
    if not isinstance(decoder.target, BatchLlama):
        why = families.why_not(getattr(decoder.target, "model", None))
        raise SpecdecError(f"distill needs a model of a family on specdec's lean path (Llama, Mistral, Qwen2/3, "
                           f"Gemma 2/3, Phi-3); '{target}' runs on transformers' forward ({why})")
    return decoder


def training_tensors(decoder: Any) -> tuple[Any, torch.Tensor, float | None]:
    """What the eagle reads when it serves (`specdec.wiring`'s feature prophet): the target's input
    embeddings as the engine holds them (Gemma's unscaled table: the engine scales after the lookup,
    the head learns from the table itself), its head (V, D) and its final soft-cap (Gemma 2) or None."""
    target = decoder.target
    embed = target.embeddings()  # a float table, or a GGUF file's Q8_0 rows (`int4.BlockEmbedding`: looked up alike)
    return (embed.detach().float() if isinstance(embed, torch.Tensor) else embed, target.head().detach().float(),
            target.arch.final_softcap)


# ----------------------------------------------------------------------------- prompts
def magpie_template(tokenizer: Any) -> tuple[list[int], set[int], str]:
    """The chat template applied to an empty user turn, cut where the user's text would start:
    (its ids, the ids that end a user turn, the text that ends it where no single token does)."""
    mark = "QQMAGPIEQQ"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    if mark not in text:
        raise SpecdecError("the tokenizer's chat template drops the user's text: cannot draw questions from it")
    before, after = text.split(mark, 1)
    prefix = tokenizer(before, add_special_tokens=False)["input_ids"]
    after_ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    special = set(getattr(tokenizer, "all_special_ids", [])) | {
        int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    ends = {int(after_ids[0])} if after_ids and int(after_ids[0]) in special else set()
    return list(prefix), ends, after.strip().split("\n")[0]


def draw_questions(decoder: Any, work: Work, want: int, seconds: float, settings: Settings, log: Log) -> list[str]:
    """Up to `want` distinct questions the target writes from an empty user turn (T=1, top-p 0.95),
    within `seconds` (counted across resumed runs); kept in work/questions.json as they come."""
    from specdec.train.magpie import good_question, prompt_key

    path = work.root / "questions.json"
    got: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"questions": [], "sampled": 0,
                                                                               "seconds": 0.0}
    prefix, ends, end_text = magpie_template(decoder.tokenizer)
    ends |= set(decoder.eos_token_ids)
    seen = {prompt_key(q) for q in got["questions"]}
    while len(got["questions"]) < want and got["seconds"] < seconds and got["sampled"] < 20 * max(want, 1):
        t0, n = time.monotonic(), settings.batch_size
        jobs = [{"prompt": prefix, "max_new_tokens": QUESTION_TOKENS, "temperature": 1.0, "top_p": 0.95,
                 "seed": _seed(settings.seed, "question", got["sampled"] + i)} for i in range(n)]
        for g in decoder.generate_many(jobs, max_batch=n):
            toks = list(g.token_ids)
            cut = next((i for i, t in enumerate(toks) if t in ends), None)
            text = decoder.tokenizer.decode(toks[:cut] if cut is not None else toks, skip_special_tokens=True)
            if cut is None:  # no end-of-turn token: the template's closing text, else cut off or rambling
                if not end_text or end_text not in text:
                    continue
                text = text.split(end_text, 1)[0]
            text = text.strip()
            if good_question(text) and prompt_key(text) not in seen:
                seen.add(prompt_key(text))
                got["questions"].append(text)
        got["sampled"] += n
        got["seconds"] += time.monotonic() - t0
        _write_json(path, got)
        work.spend("answers", time.monotonic() - t0)
        log(f"questions: {len(got['questions'])} of {want} ({got['sampled']} sampled)")
    return list(got["questions"][:want])


def own_openings(decoder: Any, work: Work, want: int, seconds: float, settings: Settings) -> list[list[int]]:
    """Up to `want` openings of a base model's own text within `seconds` (at least one batch):
    OPENING_TOKENS tokens sampled from its first token at T=1 (one that ends sooner is dropped)."""
    t0 = time.monotonic()
    tok = decoder.tokenizer
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    if start is None:
        raise SpecdecError("a base model with neither a BOS nor an EOS token: cannot start its own text")
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    sampled = 0
    while len(out) < want and sampled < 4 * want and (not sampled or time.monotonic() - t0 < seconds):
        n = min(settings.batch_size, 2 * (want - len(out)))
        jobs = [{"prompt": [int(start)], "max_new_tokens": OPENING_TOKENS, "temperature": 1.0,
                 "seed": _seed(settings.seed, "opening", sampled + i)} for i in range(n)]
        for g in decoder.generate_many(jobs, max_batch=n):
            ids = [int(start), *g.token_ids]
            if g.finish_reason == "length" and tuple(ids) not in seen:
                seen.add(tuple(ids))
                out.append(ids)
        sampled += n
    work.spend("answers", time.monotonic() - t0)
    return out[:want]


def build_prompts(decoder: Any, work: Work, budget: Budget, settings: Settings, log: Log) -> list[dict[str, Any]]:
    """The run's prompt list as token ids (work/prompts.json, made once: a resumed run answers the same)."""
    path = work.root / "prompts.json"
    if path.exists():
        return list(json.loads(path.read_text()))
    from specdec.data.tasks import task_prompts

    # enough prompts for the data budget at a generous rate; the deadline stops answering
    n = settings.prompts or max(64, int(budget.share("data") / 60 * 80))
    tok = decoder.tokenizer
    prompts: list[dict[str, Any]] = []
    if getattr(tok, "chat_template", None):
        questions = draw_questions(decoder, work, n // 2, budget.share("data") * QUESTION_SHARE, settings, log)
        tasks = task_prompts(n - len(questions), settings.seed)
        texts = [("magpie", q) for q in questions] + list(tasks)
        random.Random(settings.seed).shuffle(texts)
        prompts = [{"category": c, "text": t, "ids": decoder.chat_ids([{"role": "user", "content": t}])}
                   for c, t in texts]
        log(f"prompts: {len(questions)} questions the target wrote, {len(tasks)} task prompts")
    else:
        openings = own_openings(decoder, work, n, budget.share("data") * QUESTION_SHARE, settings)
        prompts = [{"category": "own-text", "ids": ids} for ids in openings]
        log(f"prompts: {len(prompts)} openings of the target's own text (a base model: no chat template)")
    if not prompts:
        raise SpecdecError("the target wrote no usable prompts: give it more --minutes")
    _write_json(path, prompts)
    return prompts


# ----------------------------------------------------------------------------- stage 1: answers
def answer(decoder: Any, work: Work, budget: Budget, settings: Settings, log: Log) -> None:
    """The prompts answered batch by batch into work/shard-*.pt (ids only), until every batch is
    answered or the answers' share of the time is spent. The first batch's features are read at
    once: their cost against its answering's splits the data share between the two stages."""
    from specdec.train.selfdistill import answer_into_shards

    prompts = build_prompts(decoder, work, budget, settings, log)
    size = settings.batch_size
    batches = [list(range(i, min(i + size, len(prompts)))) for i in range(0, len(prompts), size)]
    t_stage = time.monotonic()
    label = "stage 1 of 3, answers"

    def one(bi: int) -> tuple[dict[str, Any], int]:
        t0 = time.monotonic()
        rows = [prompts[i] for i in batches[bi]]
        temperature = TEMPERATURES[bi % len(TEMPERATURES)]
        jobs = [{"prompt": p["ids"], "max_new_tokens": settings.max_new_tokens, "temperature": temperature,
                 "seed": _seed(settings.seed, "answer", i)} for p, i in zip(rows, batches[bi], strict=True)]
        gens = decoder.generate_many(jobs, max_batch=len(jobs))
        work.spend("answers", time.monotonic() - t0)
        if bi == 0:
            work.state["first_batch_s"] = time.monotonic() - t0
        return ({"ids": [list(p["ids"]) + list(g.token_ids) for p, g in zip(rows, gens, strict=True)],
                 "prompt_len": [len(p["ids"]) for p in rows], "category": [p["category"] for p in rows],
                 "temperature": temperature}, sum(len(g.token_ids) for g in gens))

    answer_into_shards(work.root, [0], None, label, one, log)  # the first batch whatever the time
    if "ratio" not in work.state:
        first = work.shards()[0]
        seconds = read_features(decoder, work, [first], log)
        work.state["ratio"] = seconds / max(work.state.get("first_batch_s", seconds), 1e-3)
        work.save()
    budget.ratio = float(work.state["ratio"])
    log(f"{label}: {len(batches)} batches of up to {size}; reading a batch's features costs {budget.ratio:.2f}x "
        f"answering it, so answers get {budget.share('answers') / 60:.1f} min and features "
        f"{budget.share('features') / 60:.1f}; answers {_ends(time.time(), budget.left('answers'))}")
    answer_into_shards(work.root, list(range(len(batches))), time.monotonic() + budget.left("answers"), label, one,
                       log)
    log(f"answers: {len(work.shards())} of {len(batches)} batches in {(time.monotonic() - t_stage) / 60:.1f} min "
        "this run")
    work.finish("data")


# ----------------------------------------------------------------------------- stage 2: features
def add_features(decoder: Any, work: Work, log: Log) -> None:
    """Every answered shard without features gets them (`read_features`)."""
    todo = [p for p in work.shards() if "hidden" not in torch.load(p, weights_only=False, mmap=True)]
    if todo:
        t0 = time.monotonic()
        log(f"stage 2 of 3, features: {len(todo)} shards")
        read_features(decoder, work, todo, log)
        log(f"features: {len(todo)} shards in {(time.monotonic() - t0) / 60:.1f} min")
    work.finish("features")


@torch.inference_mode()
def read_features(decoder: Any, work: Work, paths: list[Path], log: Log, rows: int = 8) -> float:
    """The shards `paths` get their features: the target's own pass (`forward_features` of its
    engine, `rows` sequences of similar length at a time) reads each sequence once, keeping its
    last hidden state (after the final norm, what the head reads) at every position but the last.
    Shards are rewritten one at a time (a resumed run goes on). Returns the seconds spent."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from specdec.train.selfdistill import save_atomic

    lm = decoder.target.view(rows)  # the same weights, caches of its own
    total = 0.0
    with Progress(TextColumn("stage 2 of 3, features"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=Console(stderr=True)) as bar:
        task = bar.add_task("", total=len(paths), rate="")
        for path in paths:
            t0 = time.monotonic()
            shard = torch.load(path, weights_only=False)
            seqs = [list(s) for s in shard["ids"]]
            hidden: list[torch.Tensor] = [torch.zeros(0)] * len(seqs)
            order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
            for j in range(0, len(order), rows):
                part = order[j : j + rows]
                feeds = [seqs[i][:-1] for i in part]
                slots = list(range(len(part)))
                _, h = lm.forward_features(slots, [0] * len(part), feeds, [len(f) for f in feeds], head=False)
                for b, i in enumerate(part):
                    hidden[i] = h[b, : len(feeds[b])].to(torch.bfloat16).clone()
                for slot in slots:
                    lm.free(slot)
            shard["hidden"] = hidden
            save_atomic(shard, path)
            spent = time.monotonic() - t0
            total += spent
            work.spend("features", spent)
            bar.update(task, advance=1, rate=f"{sum(len(s) - 1 for s in seqs) / spent:.0f} positions/s")
    return total


# ----------------------------------------------------------------------------- stage 3: training
def eagle_settings(dim: int, seconds: float, steps_per_s: float) -> dict[str, Any]:
    """The eagle's shape and schedule for a hidden size: rank about half of it (a multiple of 32,
    as the block kernels take; SmolLM2's 576 gets 320 as configs/smollm2.toml), the cosine
    schedule's end at the steps the budget allows."""
    rank = max(32, min(1024, round(dim * 0.55 / 32) * 32))
    steps = max(1, int(seconds * steps_per_s))
    return {**EAGLE, "rank": rank, "est_steps": steps, "eval_every": max(25, min(500, steps // 12))}


def steps_per_second(dim: int, rank: int, vocab: int) -> float:
    """Training steps a second on this machine, measured on two steps of random data of the shape."""
    from specdec.prophets.feature import FeatureHead

    head = FeatureHead("eagle", dim, rank, DEPTH)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
    b, sub = BATCH, torch.randn(vocab, dim).to(torch.bfloat16)
    h, e = torch.randn(b, dim), torch.randn(b, dim)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        g, loss = h, torch.zeros(())
        for _ in range(UNROLL):
            g = head.step(g, e)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss + (g @ sub.T).float().logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return 1.0 / max(min(times[1:]), 1e-6)


def train(decoder: Any, work: Work, budget: Budget, out: Path, target: str, key: str, settings: Settings,
          log: Log) -> dict[str, Any]:
    """The eagle head trained on the shards (resuming work/eagle.ckpt) for the time left, exported to `out`."""
    from specdec.train.features import draft_vocabulary, export, load_shards, train_head

    embed, head, softcap = training_tensors(decoder)
    vocab_size, dim = head.shape
    data = load_shards(work.root, UNROLL, vocab_size=vocab_size)
    if len(data.starts_train) == 0 or len(data.starts_heldout) == 0:
        raise SpecdecError(f"too few answers to train on ({len(data.starts_train)} training positions, "
                           f"{len(data.starts_heldout)} held out): give it more --minutes or --prompts")
    always = sorted({int(i) for i in decoder.eos_token_ids} & set(range(vocab_size)))
    vocab = draft_vocabulary(data.answer_counts, min(DRAFT_VOCAB, vocab_size), always)
    coverage = float(data.answer_counts[vocab].sum()) / max(1, int(data.answer_counts.sum()))
    # the time left, at least a tenth of the whole (a run over its data budget still trains)
    seconds = max(budget.total_left(), 0.1 * budget.minutes * 60)
    total = seconds + work.state["spent"].get("train", 0.0)
    rank = eagle_settings(dim, 0, 1)["rank"]
    cfg = eagle_settings(dim, total, steps_per_second(dim, rank, len(vocab)))
    log(f"stage 3 of 3, training: {len(data.starts_train):,} training positions, {len(data.starts_heldout):,} held "
        f"out; draft vocabulary {len(vocab)} ids covering {coverage:.4f} of answer tokens; rank {cfg['rank']}, "
        f"~{cfg['est_steps']:,} steps; {_ends(time.time(), seconds)}")
    data.targets_from_cache(work.root / "targets.pt", head, softcap)
    t0 = time.monotonic()
    trained, info = train_head("eagle", data, embed, head, vocab, cfg, work.root / "eagle.ckpt", total / 60,
                               settings.max_steps, log=log)
    work.spend("train", time.monotonic() - t0)
    meta = {"target": target, "weights_key": key, "vocab_size": int(vocab_size), "draft_vocab": len(vocab),
            "draft_vocab_coverage": round(coverage, 4), "answer_tokens": data.n_answer_tokens,
            "sequences": int(sum(len(torch.load(p, weights_only=False, mmap=True)["ids"]) for p in work.shards())),
            "training": info, "config": cfg}
    export(trained, vocab, out, meta)
    _write_json(evaluation_path(out), meta)
    work.finish("train")
    return meta


def evaluation_path(out: Path) -> Path:
    """Where a prophet's held-out agreement is written: beside it, <out>-evaluation.json (as models/)."""
    return out.parent / f"{out.name}-evaluation.json"


# ----------------------------------------------------------------------------- the whole run
def default_out(key: str) -> Path:
    """Where `load(X)` finds X's prophet (`specdec.defaults.trained_prophet`)."""
    return prophets_dir() / key / "eagle"


def run(target: str, minutes: float, out: Path | None = None, settings: Settings | None = None,
        log: Log = print) -> tuple[Path, dict[str, Any]]:
    """The three stages for `target` within `minutes` (resuming its work folder); returns the
    prophet's folder and its report (held-out agreement under ["training"]["heldout_agreement"])."""
    settings = settings or Settings()
    if not 0 < minutes < float("inf"):
        raise SpecdecError(f"--minutes must be a finite number > 0, got {minutes:g}")
    if is_alias(target) and out is None:
        raise SpecdecError("smollm2 ships its own eagle (models/smollm2-eagle), which load('smollm2') uses by "
                           "default: pass --out DIR to train another beside it")
    key = target_key(target)
    out = out or default_out(key)
    work = Work(cache_dir() / "distill" / key)
    budget = Budget(minutes, work.state["spent"], work.state.get("ratio"))
    if work.done("train") and (out / "prophet.json").is_file():
        log(f"already trained for these weights: {out} (delete {work.root} to start again)")
        return out, json.loads(evaluation_path(out).read_text())
    decoder = load_lean(target)
    work.state.update(target=target, minutes=minutes)
    work.save()
    log(f"distill {target} (weights {key}): {budget.describe()}; work folder {work.root}")
    if not work.done("data"):
        answer(decoder, work, budget, settings, log)
    if not work.done("features"):
        add_features(decoder, work, log)
    meta = train(decoder, work, budget, out, target, key, settings, log)
    return out, meta


def agreement_line(meta: dict[str, Any]) -> str:
    held = meta["training"]["heldout_agreement"]
    return "held-out greedy agreement by draft step: " + ", ".join(f"{j}: {a:.3f}" for j, a in enumerate(held, 1))


__all__ = ["Budget", "Settings", "agreement_line", "default_out", "magpie_template", "run", "target_key",
           "training_tensors"]
