"""The README's pictures, drawn from measured rows (matplotlib, the bench extra): the frontier (file size
against KLD on each built-in text, qlite's files beside llama.cpp's) and decode speed. Each function
writes a PNG and returns the points it drew, read back from the figure, so a test can check them."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qlite.errors import QliteError

QLITE, LLAMA = "#2d5bd7", "#d0782a"


@dataclass
class Point:
    label: str
    mib: float
    kld: dict  # text -> mean KLD
    llama_cpp: bool = False
    pass_diff: float | None = None  # percentage points against the 16-bit model, where measured


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise QliteError("--plot needs matplotlib (pip install 'qlite[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def drawn(ax) -> list[tuple[float, float]]:
    return [tuple(map(float, xy)) for c in ax.collections for xy in c.get_offsets()]


def frontier(points: list[Point], path: Path, texts=("code", "prose"), title: str = "") -> dict[str, list]:
    """Size against KLD, a panel per text (and one for the pass-rate difference where the points have
    it); returns each panel's drawn (x, y) points."""
    plt = pyplot()
    with_pass = [p for p in points if p.pass_diff is not None]
    panels = [*texts, *(["pass"] if with_pass else [])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    result = {}
    for ax, panel in zip(axes[0], panels):
        shown = with_pass if panel == "pass" else [p for p in points if panel in p.kld]
        for p in shown:
            y = p.pass_diff if panel == "pass" else p.kld[panel]
            ax.scatter([p.mib], [y], color=LLAMA if p.llama_cpp else QLITE, marker="s" if p.llama_cpp else "o", s=36)
            ax.annotate(p.label, (p.mib, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        if panel == "pass":
            ax.axhline(0, color="#999", lw=0.8)
            ax.axhline(-2, color="#999", lw=0.8, ls="--")
            ax.set_ylabel("pass rate - 16-bit's (points)")
        else:
            ax.set_yscale("log")
            ax.set_ylabel(f"mean KLD on the {panel} text (nats, log)")
        ax.set_xlabel("file size (MiB)")
        ax.grid(alpha=0.3)
        result[panel] = drawn(ax)
    handles = [plt.Line2D([], [], color=QLITE, marker="o", ls=""), plt.Line2D([], [], color=LLAMA, marker="s", ls="")]
    fig.legend(handles, ["qlite", "llama.cpp"], loc="lower center", ncol=2)  # below the panels: over none of them
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return result


def speed(rows: list[tuple[str, float, float, float, bool]], path: Path, title: str = "") -> list[tuple[float, float]]:
    """Decode tokens/s as bars, (label, median, min, max, is llama.cpp) a row; returns the drawn (x, y)
    of each bar's top (x: the bar's index)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
    ys = list(range(len(rows)))[::-1]
    medians = [r[1] for r in rows]
    errors = [[r[1] - r[2] for r in rows], [r[3] - r[1] for r in rows]]
    bars = ax.barh(ys, medians, xerr=errors, color=[LLAMA if r[4] else QLITE for r in rows], capsize=3)
    ax.set_yticks(ys, [r[0] for r in rows])
    ax.set_xlabel("decode tokens/s (median, min-max)")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [(float(round(len(rows) - 1 - b.get_y() - b.get_height() / 2)), float(b.get_width())) for b in bars]
