"""The pipeline part of a report: the Gantt chart of the last step and the bubble table."""

from __future__ import annotations

import json
from pathlib import Path

from paratrain.parallel.pp.timeline import bubble_table, render_gantt


def pipeline_report(run_dir: Path) -> str | None:
    """timeline.json -> timeline.png and bubbles.md; None when the run had no pipeline."""
    source = run_dir / "timeline.json"
    if not source.is_file():
        return None
    timeline = json.loads(source.read_text())
    png = render_gantt(timeline, run_dir / "timeline.png")
    table = bubble_table(timeline)
    (run_dir / "bubbles.md").write_text(table + "\n")
    return f"pipeline timeline: {png}\n\n{table}"
