"""`cachepoint-admin sessions --png`: a session's reads and writes per turn, with its
cache breaks marked, as a picture (matplotlib, imported only when asked for)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cachepoint.gateway.admin.sessions import Turn

READ, WRITE, INPUT, BREAK = "#55A868", "#DD8452", "#8C8C8C", "#C44E52"


class PictureError(RuntimeError):
    """The picture cannot be drawn here (no matplotlib)."""


def draw(turns: Sequence[Turn], path: Path, title: str) -> Path:
    """Stacked bars per turn (cache read, cache write, uncached input, in tokens); each
    turn that broke the cache gets its reason above its bar, in red."""
    try:
        import matplotlib
    except ImportError:
        raise PictureError(
            "--png needs matplotlib, which this install lacks: pip install matplotlib"
        ) from None
    matplotlib.use("Agg")  # no screen: files only
    import matplotlib.pyplot as plt

    x = [t.index for t in turns]
    read = [t.buckets.cache_read_input_tokens for t in turns]
    write = [t.written for t in turns]
    plain = [t.buckets.input_tokens for t in turns]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(turns) + 3), 4.5))
    ax.bar(x, read, color=READ, label="cache read")
    ax.bar(x, write, bottom=read, color=WRITE, label="cache write")
    tops = [r + w for r, w in zip(read, write, strict=True)]
    ax.bar(x, plain, bottom=tops, color=INPUT, label="uncached input")
    high = max((r + w + p for r, w, p in zip(read, write, plain, strict=True)), default=1)
    for t, top in zip(turns, tops, strict=True):
        if t.broke:
            # NOTE: "none" is a row billed before the server's outcome reasons existed:
            # the prompt only appended, so the entry was gone.
            label = {None: "not diagnosed", "none": "entry gone"}.get(t.reason, t.reason)
            label = f"{label} ({t.detail})" if t.detail else label
            if t.missed:
                label += f"\n{t.missed} tok"
            ax.annotate(
                label,
                (t.index, top + t.buckets.input_tokens),
                xytext=(0, 4),
                textcoords="offset points",
                ha="center",
                fontsize=7,
                color=BREAK,
            )
            ax.bar(t.index, t.written, bottom=t.buckets.cache_read_input_tokens,
                   fill=False, edgecolor=BREAK, linewidth=1.5)  # fmt: skip
    ax.set_ylim(0, high * 1.25)  # room for the labels
    ax.set_xticks(x)
    ax.set_xlabel("turn")
    ax.set_ylabel("prompt tokens")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
