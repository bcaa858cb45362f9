"""The planner's step-time model against this machine's measurements (`benchmarks/planner_ranking.py`,
committed in benchmarks/results/planner_ranking.json): the JSON is the current planner's (every prediction is
recomputed from its recorded calibrations), it covers at least 12 layouts of at least 3 kinds, its worst error
meets the target, and its rank correlation is at least the floor docs/planner.md states (the 0.9 target is not
met: seven of the layouts lie within 7% of each other, closer than this machine's run-to-run noise). Timings
are read, never taken: no test here measures anything."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from benchmarks.planner_ranking import LAYOUTS, SPEC, TARGETS, hardware_for_this_cpu, spearman
from paratrain.planner import estimate_time

ROOT = Path(__file__).resolve().parents[2]
SPEARMAN_FLOOR = 0.8  # what docs/planner.md states the test asserts (the committed run: 0.86)
RESULT = json.loads((ROOT / "benchmarks" / "results" / "planner_ranking.json").read_text())


def _kind(layout) -> str:
    for axis in ("tp", "pp", "cp"):
        if getattr(layout, axis) > 1:
            return axis
    if layout.dp > 1:
        return f"zero{layout.zero_stage}" if layout.zero_stage else "ddp"
    return "one process"


def _current_predictions() -> tuple[list[list[float]], list[float]]:
    """Each layout's step time predicted by the planner as it is now, from each repeat's recorded calibration
    (per repeat, and the medians the ranking compares with the measurements)."""
    hardware = [hardware_for_this_cpu(c["compute"], c["comm"]) for c in RESULT["calibrations"]]
    runs = [[estimate_time(SPEC, lay, hw).total for hw in hardware] for lay in LAYOUTS]
    return runs, [statistics.median(r) for r in runs]


def test_the_result_is_the_benchmarks_layouts_and_the_current_planners_predictions():
    assert RESULT["layouts"] == [lay.describe() for lay in LAYOUTS]
    runs, medians = _current_predictions()
    for lay, now, recorded in zip(LAYOUTS, runs, RESULT["predicted_runs"]):
        assert now == pytest.approx(recorded, rel=1e-9), \
            f"{lay.describe()}: the planner changed since the JSON; rerun benchmarks.planner_ranking"
    assert medians == pytest.approx(RESULT["predicted_s"], rel=1e-9)  # the predictions ranked below are these


def test_at_least_12_layouts_of_3_kinds_within_the_worst_error_target():
    _, predicted = _current_predictions()  # the current planner's, never the JSON's copy
    measured = RESULT["measured_s"]
    assert len(LAYOUTS) >= 12 and len({_kind(lay) for lay in LAYOUTS}) >= 3
    rho = spearman(predicted, measured)
    worst = max(max(p / m, m / p) for p, m in zip(predicted, measured))
    assert rho == pytest.approx(RESULT["spearman"]) and worst == pytest.approx(RESULT["worst_ratio"])
    assert worst <= TARGETS["worst_ratio"], f"worst prediction off by {worst:.2f}x, above {TARGETS['worst_ratio']}x"
    assert rho >= SPEARMAN_FLOOR, f"Spearman {rho:.3f} below the documented {SPEARMAN_FLOOR}"


def test_docs_state_the_measured_correlation_and_worst_error():
    text = (ROOT / "docs" / "planner.md").read_text()
    stated = re.search(r"Spearman ρ (\d\.\d\d), worst prediction off\s+by (\d\.\d\d)×", text)
    assert stated, "docs/planner.md states the time ranking's Spearman and worst error"
    assert float(stated.group(1)) == round(RESULT["spearman"], 2)
    assert float(stated.group(2)) == round(RESULT["worst_ratio"], 2)
    assert f"at least {SPEARMAN_FLOOR}" in text and f"target {TARGETS['spearman']}" in text
    prose = " ".join(text.split())
    ratios = [p / m for p, m in zip(RESULT["predicted_s"], RESULT["measured_s"])]
    assert f"(every layout within {min(ratios):.2f}–{max(ratios):.2f}× of its measurement)" in prose
    tp = [r for r, lay in zip(ratios, LAYOUTS) if lay.tp > 1]
    assert f"The most under-predicted layouts are TP's ({min(tp):.2f}–{max(tp):.2f}×)" in prose
    low, high, n = re.search(r"(\d+) of the 14 layouts are measured between (\d\.\d\d) and (\d\.\d\d) s",
                             prose).group(2, 3, 1)
    close = sum(float(low) <= round(m, 2) <= float(high) for m in RESULT["measured_s"])
    assert int(n) == close, close
    spread = max(max(r) / min(r) for r in RESULT["measured_runs"])
    assert f"three repeats differ by up to {round((spread - 1) * 100)}%" in prose
