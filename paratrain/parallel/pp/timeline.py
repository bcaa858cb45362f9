"""The pipeline timeline: what every rank executed in a step and when, its bubble, and a Gantt chart.

A timeline is plain JSON-able data (`gather_timeline` collects the runners' last step over the world):

    {"schedule": "1f1b", "stages": 4, "virtual": 1, "micro_batches": 8, "split_backward": false,
     "ranks": [{"rank": 0, "pp": 0, "dp": 0, "events": [["F", stage, micro, start_s, end_s], ...],
                "peak_in_flight": 4}, ...],
     "theory": 0.273, "unit_idle": [0.273, ...]}

The measured bubble of a rank is the part of its replica's step span (first start to last end over the
replica's pp ranks) in which it computed nothing. `theory` is the formula for the schedule and
`unit_idle` the idle fraction of the same action lists simulated with F = B = W = 1.
"""

from __future__ import annotations

from pathlib import Path

import paratrain.comm as comm
from paratrain.parallel.pp.schedules import build_schedule
from paratrain.parallel.pp.validate import simulate, theoretical_bubble

COLORS = {"F": "#4C72B0", "B": "#DD8452", "B_split": "#55A868", "W": "#8172B3"}


def gather_timeline(runner) -> dict:
    """Collective over the world: every rank's events of the runner's last step."""
    mesh, s = runner.mesh, runner.last_schedule
    mine = {"rank": mesh.rank, "pp": mesh.local_rank("pp"), "dp": mesh.local_rank("dp"),
            "events": [list(e) for e in runner.last_events], "peak_in_flight": runner.last_peak_in_flight}
    ranks = comm.all_gather_object(mine, mesh.world, tag="timeline")
    return {"schedule": s.name, "stages": s.stages, "virtual": s.virtual, "micro_batches": s.micro_batches,
            "split_backward": s.split_backward, "forward_only": s.forward_only, "ranks": ranks,
            "theory": theoretical_bubble(s), "unit_idle": simulate(s).idle_fraction}


def _schedule_of(timeline: dict):
    return build_schedule(timeline["schedule"], timeline["stages"], timeline["micro_batches"], timeline["virtual"],
                          forward_only=timeline.get("forward_only", False))


def measured_bubbles(timeline: dict) -> list[dict]:
    """Per rank: busy and span seconds and the idle fraction of its replica's step span."""
    spans: dict[int, tuple[float, float]] = {}
    for r in timeline["ranks"]:
        if r["events"]:
            lo, hi = spans.get(r["dp"], (float("inf"), float("-inf")))
            spans[r["dp"]] = (min(lo, min(e[3] for e in r["events"])), max(hi, max(e[4] for e in r["events"])))
    out = []
    for r in sorted(timeline["ranks"], key=lambda r: (r["dp"], r["pp"])):
        lo, hi = spans.get(r["dp"], (0.0, 0.0))
        busy = sum(e[4] - e[3] for e in r["events"])
        span = hi - lo
        out.append({"rank": r["rank"], "pp": r["pp"], "dp": r["dp"], "busy_s": busy, "span_s": span,
                    "bubble": 1.0 - busy / span if span > 0 else 0.0,
                    "unit_bubble": timeline["unit_idle"][r["pp"]], "theory": timeline["theory"]})
    return out


def bubble_table(timeline: dict) -> str:
    """A markdown table: measured bubble per rank next to the unit-slot simulation and the formula."""
    head = (f"Schedule **{timeline['schedule']}**, p = {timeline['stages']}, m = {timeline['micro_batches']}, "
            f"v = {timeline['virtual']}.\n\n| rank | pp | dp | busy (ms) | step span (ms) | measured bubble "
            f"| unit-slot bubble | theory |\n|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = [f"| {b['rank']} | {b['pp']} | {b['dp']} | {b['busy_s'] * 1e3:.1f} | {b['span_s'] * 1e3:.1f} | "
            f"{b['bubble']:.3f} | {b['unit_bubble']:.3f} | {b['theory']:.3f} |" for b in measured_bubbles(timeline)]
    return "\n".join([head, *rows])


def _unit_events(timeline: dict) -> list[list]:
    sim = simulate(_schedule_of(timeline))
    return [[[a.kind.value, a.stage, a.micro, start, end] for a, start, end in events] for events in sim.events]


def _draw(ax, rows: list[tuple[str, list]], split: bool, virtual: int, stages: int, scale: float, unit: str) -> None:
    span = max((e[4] for _, events in rows for e in events), default=1.0)
    for y, (_, events) in enumerate(rows):
        for kind, stage, micro, start, end in events:
            color = COLORS["B_split"] if kind == "B" and split else COLORS[kind]
            chunk = stage // stages
            ax.barh(y, (end - start) * scale, left=start * scale, height=0.8, color=color,
                    alpha=1.0 if chunk == 0 else 0.6, edgecolor="white", linewidth=0.5)
            label = f"{micro}" if virtual == 1 else f"{micro}.{chunk}"  # micro-batch.chunk
            if end - start >= 0.005 * len(label) * span:  # only where the number fits
                ax.text((start + end) / 2 * scale, y, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel(unit)


def render_gantt(timeline: dict, path: str | Path) -> Path:
    """Draw the measured step (top) and the same schedule in unit slots (bottom) into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    bubbles = {b["rank"]: b for b in measured_bubbles(timeline)}
    ranks = sorted(timeline["ranks"], key=lambda r: (r["dp"], r["pp"]))
    t0 = min((e[3] for r in ranks for e in r["events"]), default=0.0)
    measured = [(f"rank {r['rank']} (pp{r['pp']} dp{r['dp']})\nbubble {bubbles[r['rank']]['bubble']:.0%}",
                 [[k, s, m, a - t0, b - t0] for k, s, m, a, b in r["events"]]) for r in ranks]
    unit = [(f"pp{i}  bubble {idle:.0%}", ev) for i, (idle, ev) in
            enumerate(zip(timeline["unit_idle"], _unit_events(timeline)))]
    split, v, p = timeline["split_backward"], timeline["virtual"], timeline["stages"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 1.2 + 0.55 * (len(measured) + len(unit))),
                                      gridspec_kw={"height_ratios": [max(len(measured), 1), max(len(unit), 1)]})
    _draw(top, measured, split, v, p, 1e3, "time (ms)")
    top.set_title(f"{timeline['schedule']}: p = {p}, m = {timeline['micro_batches']}, v = {v} — measured step",
                  loc="left")
    _draw(bottom, unit, split, v, p, 1.0, "unit slots (F = B = W = 1)")
    bottom.set_title(f"the same schedule in unit slots — theory {timeline['theory']:.1%} bubble", loc="left")
    legend = [Patch(color=COLORS["F"], label="F forward")]
    legend += [Patch(color=COLORS["B_split"], label="B input grad"), Patch(color=COLORS["W"], label="W weight grad")] \
        if split else [Patch(color=COLORS["B"], label="B backward")]
    top.legend(handles=legend, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(legend), fontsize=8,
               frameon=False)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
