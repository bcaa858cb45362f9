"""The pictures of a run's per-step metrics: loss, throughput, per-rank memory, communication per axis, for
an MoE model the tokens per expert, and for a dpo run the reward accuracy and margin.

Each function takes the rows of `metrics.jsonl` (one dict per optimizer step, see paratrain/trainer/job.py) and
writes one PNG. matplotlib is optional (`pip install paratrain[plot]`); it is imported here only.
"""

from __future__ import annotations

import statistics
from pathlib import Path

MIB = 2**20


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _rolling_median(values: list[float], window: int) -> list[float]:
    return [statistics.median(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def plot_loss(rows: list[dict], path: Path, evaluations: list[dict] = ()) -> Path:
    """`evaluations`: rows with a validation loss and no training step (step 0 of trainer.eval_at_start)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1.2, label="training loss (global batch)")
    val = [(r["step"], r["val_loss"]) for r in sorted([*evaluations, *rows], key=lambda r: r["step"])
           if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", color="tab:red", ms=4, label="validation loss")
    ax.set(xlabel="optimizer step", ylabel="loss", title="Loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


EVENT_STYLE = {"checkpoint save": ("tab:red", "--"), "evaluation": ("tab:green", ":"),
               "per-rank memory gather": ("tab:gray", ":")}


def mark_events(ax, events: dict[str, list[int]]) -> None:
    """A vertical line at each step that did more than train (`metrics.step_events`), one legend entry a kind."""
    for kind, steps in events.items():
        color, style = EVENT_STYLE[kind]
        for i, step in enumerate(steps):
            ax.axvline(step, color=color, ls=style, lw=0.8, alpha=0.7, label=kind if i == 0 else None)


def plot_throughput(rows: list[dict], path: Path, events: dict[str, list[int]] | None = None) -> Path:
    plt = _pyplot()
    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    window = max(1, len(rows) // 20)
    tokens = [r["tokens_per_s"] for r in rows]
    top.plot(steps, tokens, lw=0.6, alpha=0.4, color="tab:blue", label="per step")
    top.plot(steps, _rolling_median(tokens, window), lw=1.6, color="tab:blue",
             label=f"median of {window} step{'s' if window > 1 else ''}")
    top.set(ylabel="tokens / s", title="Throughput")
    top.legend()
    times = [r["step_time_s"] * 1000 for r in rows]
    bottom.plot(steps, times, lw=0.6, alpha=0.4, color="tab:orange")
    bottom.plot(steps, _rolling_median(times, window), lw=1.6, color="tab:orange")
    bottom.set(xlabel="optimizer step", ylabel="step time (ms)")
    mark_events(bottom, events or {})
    if events:
        bottom.legend(fontsize=8)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    return _save(fig, path)


def plot_data(rows: list[dict], path: Path) -> Path | None:
    """A data-section job's padding fraction and loader wait per step (None for a corpus run)."""
    rows = [r for r in rows if "padding_fraction" in r]
    if not rows:
        return None
    plt = _pyplot()
    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.plot(steps, [100 * r["padding_fraction"] for r in rows], lw=1.2, color="tab:purple")
    top.set(ylabel="padding (% of positions)", title="Data: padding and loader wait")
    bottom.plot(steps, [1000 * r["loader_wait_s"] for r in rows], lw=1.2, color="tab:green")
    bottom.set(xlabel="optimizer step", ylabel="loader wait per step (ms)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    return _save(fig, path)


def plot_preference(rows: list[dict], path: Path) -> Path | None:
    """A dpo run's reward accuracy and margin per step (training: the global batch; evaluations: the held-out
    pairs), TRL's rewards/accuracies and rewards/margins; None without them."""
    trained = [r for r in rows if "rewards/accuracies" in r]
    held_out = [r for r in rows if "eval/rewards/accuracies" in r]
    if not trained and not held_out:
        return None
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    for ax, name, label in ((top, "rewards/accuracies", "reward accuracy"), (bottom, "rewards/margins",
                                                                              "reward margin")):
        if trained:
            steps, values = [r["step"] for r in trained], [r[name] for r in trained]
            ax.plot(steps, values, lw=0.6, alpha=0.4, color="tab:blue")
            window = max(1, len(values) // 20)
            ax.plot(steps, _rolling_median(values, window), lw=1.6, color="tab:blue",
                    label=f"training (median of {window} step{'s' if window > 1 else ''})")
        if held_out:
            ax.plot([r["step"] for r in held_out], [r[f"eval/{name}"] for r in held_out], "o-", ms=4,
                    color="tab:red", label="held-out pairs")
        ax.set(ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    top.set(title="DPO: rewards of chosen over rejected (beta x log-ratio to the reference)", ylim=(-0.02, 1.02))
    top.axhline(0.5, color="gray", lw=0.8, ls=":")
    bottom.axhline(0.0, color="gray", lw=0.8, ls=":")
    bottom.set(xlabel="optimizer step")
    return _save(fig, path)


def plot_rewards(rows: list[dict], path: Path) -> Path | None:
    """A grpo run's reward per rollout batch (and each reward function's mean), with the completions' mean length;
    None without rewards."""
    rows = [r for r in rows if "reward" in r]
    if not rows:
        return None
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    steps, window = [r["step"] for r in rows], max(1, len(rows) // 20)
    names = ["reward", *(k for k in rows[0] if k.startswith("rewards/") and k.endswith("/mean"))]
    for name, color in zip(names, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")):
        values = [r[name] for r in rows]
        top.plot(steps, values, lw=0.5, alpha=0.3, color=color)
        top.plot(steps, _rolling_median(values, window), lw=1.6, color=color,
                 label=name if name == "reward" else name.split("/")[1])
    top.set(title=f"GRPO: rewards per rollout batch (lines: median of {window})", ylabel="reward")
    top.grid(alpha=0.3)
    top.legend(fontsize=8)
    bottom.plot(steps, [r["completions/mean_length"] for r in rows], lw=1.0, color="tab:gray")
    bottom.set(xlabel="optimizer step", ylabel="completion tokens (mean)")
    bottom.grid(alpha=0.3)
    return _save(fig, path)


def plot_memory(per_rank_state: list[int], per_rank_rss: list[int] | None, path: Path) -> Path:
    """Model-state bytes per rank (what the strategy keeps) and, beside it, each process's peak RSS: two
    panels with their own scales, since a process carries far more than its model state."""
    plt = _pyplot()
    panels = [("model state per rank\n(params + grads + optimizer state)", per_rank_state, "tab:green")]
    if per_rank_rss:
        panels.append(("peak RSS per process", per_rank_rss, "tab:gray"))
    ranks = list(range(len(per_rank_state)))
    fig, axes = plt.subplots(1, len(panels), figsize=(max(5.0, 0.8 * len(ranks) + 2.5) * len(panels), 4),
                             squeeze=False)
    for ax, (title, values, color) in zip(axes[0], panels):
        bars = ax.bar(ranks, [v / MIB for v in values], 0.6, color=color)
        ax.bar_label(bars, fmt="%.2f" if max(values) < 10 * MIB else "%.0f", fontsize=8)
        ax.set(xlabel="global rank", ylabel="MiB", title=title, xticks=ranks)
        ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def comm_per_axis(row: dict) -> dict[str, int]:
    """Bytes this step moved on each axis (all operations, rank 0's count)."""
    return {axis: sum(op["bytes"] for op in ops.values()) for axis, ops in row.get("comm", {}).items()}


def plot_comm(rows: list[dict], path: Path, events: dict[str, list[int]] | None = None) -> Path | None:
    per_step = [comm_per_axis(r) for r in rows]
    axes = sorted({axis for step in per_step for axis in step})
    if not axes:
        return None
    plt = _pyplot()
    peak = max(sum(step.values()) for step in per_step)
    unit, scale = ("MiB", MIB) if peak >= MIB else ("KiB", 1024) if peak >= 1024 else ("B", 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    ax.stackplot(steps, [[step.get(axis, 0) / scale for step in per_step] for axis in axes], labels=axes,
                 alpha=0.8, step="mid")
    ax.set(xlabel="optimizer step", ylabel=f"{unit} per step (rank 0)", title="Communication per step, by axis")
    mark_events(ax, events or {})
    ax.grid(alpha=0.3)
    ax.legend(title="axis", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def moe_layers(rows: list[dict]) -> list[str]:
    """The MoE layers of the metrics rows (`moe_tokens`: {layer: tokens per expert}), in their order."""
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row.get("moe_tokens", {})))
    return list(names)


def plot_moe_tokens(rows: list[dict], path: Path) -> Path | None:
    """One heat map per MoE layer, stacked: experts down, optimizer steps across, colour = the expert's share
    of the layer's routed choices at that step (1 / E is a balanced routing). None without MoE rows."""
    rows = [r for r in rows if r.get("moe_tokens")]
    layers = moe_layers(rows)
    if not layers:
        return None
    plt = _pyplot()
    heights = [len(next(r["moe_tokens"][name] for r in rows if name in r["moe_tokens"])) for name in layers]
    fig, axes = plt.subplots(len(layers), 1, figsize=(7, min(2.0 + sum(0.22 * h + 0.5 for h in heights), 60.0)),
                             sharex=True, squeeze=False, height_ratios=heights)
    steps = [r["step"] for r in rows]
    image = None
    for ax, name, experts in zip(axes[:, 0], layers, heights):
        share = [[float("nan")] * len(rows) for _ in range(experts)]
        for j, row in enumerate(rows):
            counts = row["moe_tokens"].get(name)
            total = sum(counts) if counts else 0
            for e in range(experts if total else 0):
                share[e][j] = counts[e] / total
        image = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0,
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, experts - 0.5, -0.5))
        ax.set_ylabel(f"{name}\nexpert", fontsize=8)
        if experts <= 16:
            ax.set_yticks(range(experts))
    axes[-1, 0].set_xlabel("optimizer step")
    axes[-1, 0].xaxis.get_major_locator().set_params(integer=True)
    axes[0, 0].set_title("Tokens per expert (share of the layer's routed choices, all ranks)")
    fig.colorbar(image, ax=axes[:, 0].tolist(), label="share of tokens", fraction=0.05)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
