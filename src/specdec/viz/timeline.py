"""A timeline of one generation: for each round, the prophet's steps, the target's single
verification pass, and the tokens it produced (accepted / recovered / bonus)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.events import RoundEvent

COLORS = {"draft": "#7fb3d5", "target": "#e59866", "accepted": "#52be80", "recovered": "#f4d03f",
          "bonus": "#af7ac5", "rejected": "#cd6155"}


def plot_timeline(events: Sequence[RoundEvent], out: str | Path, tokenizer: Any = None,
                  max_rounds: int = 40, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = list(events)[:max_rounds]
    fig, (ax_time, ax_tok) = plt.subplots(2, 1, figsize=(12, 6), height_ratios=[1, 1.4])
    # Top: wall-clock lanes, as a profiler would show them.
    for e in events:
        for a, b in e.draft_spans:
            ax_time.barh(1, (b - a) * 1e3, left=a * 1e3, color=COLORS["draft"], edgecolor="none")
        t0, t1 = e.target_span
        ax_time.barh(0, (t1 - t0) * 1e3, left=t0 * 1e3, color=COLORS["target"], edgecolor="white")
    ax_time.set_yticks([0, 1], ["target (verify)", "prophet"])
    ax_time.set_xlabel("time (ms)")
    ax_time.set_title(title or "speculative decoding timeline")
    # Bottom: one row per round, one cell per token proposed or produced.
    for row, e in enumerate(events):
        cells = [("accepted", t) for t in e.drafted[: e.accepted]]
        if e.next_kind == "recovered" and e.accepted < len(e.drafted):
            cells.append(("rejected", e.drafted[e.accepted]))
        cells.append((e.next_kind if e.drafted else "bonus", e.next_token))
        for col, (kind, token) in enumerate(cells):
            ax_tok.add_patch(plt.Rectangle((col, -row - 1), 0.95, 0.9, color=COLORS[kind]))
            if tokenizer is not None:
                label = ascii(tokenizer.decode([token]))[1:-1][:6]  # escaped: fonts lack many glyphs
                ax_tok.text(col + 0.47, -row - 0.55, label, ha="center", va="center", fontsize=6, family="monospace",
                            parse_math=False)  # a token "$$" is text, not mathtext
    width = max((len(e.drafted) + 2 for e in events), default=2)
    ax_tok.set_xlim(0, width)
    ax_tok.set_ylim(-len(events) - 0.2, 0.1)
    ax_tok.set_xlabel("token within round")
    ax_tok.set_ylabel("round")
    ax_tok.set_yticks([])
    ax_tok.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], ncol=6, fontsize=7,
                  loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
