"""`paratrain report RUN_DIR`: turn a run directory into pictures and tables.

Each part looks for its own input in the run directory and reports what it wrote: the metrics
(`metrics.jsonl` -> `loss.png`, `throughput.png`, `memory.png`, `comm.png`, for an MoE model
`moe_tokens.png`, for a dpo run `preference.png`, for a grpo run `rewards.png`, + `summary.md`) and the pipeline
timeline (`timeline.json` -> `timeline.png` + `bubbles.md`).
"""

from __future__ import annotations

from pathlib import Path

from paratrain.report.errors import ReportError
from paratrain.report.metrics import metrics_report
from paratrain.report.pipeline import pipeline_report

PARTS = (metrics_report, pipeline_report)
__all__ = ["PARTS", "ReportError", "build_report"]


def build_report(run_dir: str | Path) -> list[str]:
    """Run every part on `run_dir`; returns the parts' summaries (empty when nothing applied)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run directory '{run_dir}' does not exist; pass the --run-dir of a `paratrain train` run")
    return [text for part in PARTS if (text := part(run_dir)) is not None]
