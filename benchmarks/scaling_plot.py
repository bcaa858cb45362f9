"""The two panels of the scaling benchmark's pictures (`benchmarks/scaling.py`): median step time and model
state per rank against world size or parameter count, one line per strategy, log scales."""

from __future__ import annotations

from pathlib import Path

MIB = 2**20


def plot(points: list[dict], x_key: str, path: Path, xlabel: str, strategies: list[str] | None = None) -> None:
    """`strategies`: the lines, in legend order (default: as they first appear in `points`)."""
    strategies = strategies or list(dict.fromkeys(p["strategy"] for p in points))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (ax_time, ax_state) = plt.subplots(1, 2, figsize=(11, 4.2))
    for strategy in strategies:
        mine = sorted((p for p in points if p["strategy"] == strategy and "skipped" not in p), key=lambda p: p[x_key])
        xs = [p[x_key] for p in mine]
        ax_time.plot(xs, [p["median_step_s"] * 1e3 for p in mine], marker="o", label=strategy)
        ax_state.plot(xs, [p["state_bytes"] / MIB for p in mine], marker="o", label=strategy)
    for ax, ylabel in ((ax_time, "median step time (ms)"), (ax_state, "model state / rank (MiB)")):
        ax.set_xscale("log", base=2 if x_key == "world" else 10)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    if x_key == "world":
        worlds = sorted({p["world"] for p in points})
        for ax in (ax_time, ax_state):
            ax.set_xticks(worlds, labels=[str(w) for w in worlds])
    ax_state.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
