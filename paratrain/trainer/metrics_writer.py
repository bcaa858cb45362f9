"""The run directory's per-step metrics: metrics.jsonl and metrics.csv, written by rank 0 as the job runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path


class MetricsWriter:
    """Rank 0 appends one JSON line and one CSV row per step; both files are flushed as they grow.

    A run resumed from a checkpoint at step k keeps the rows of steps 0..k (`kept`) and rewrites the rest, so
    the files read as one uninterrupted run. The CSV's columns are the first training row's and `columns`; an
    evaluation-only row (step 0) waits for that row before it is written there.
    """

    def __init__(self, run_dir: Path, enabled: bool, resumed_at: int = 0, columns: tuple[str, ...] = ()):
        self.enabled = enabled
        self._csv = None
        self._columns = columns
        self._waiting: list[dict] = []  # rows without a loss, before the first training row sets the columns
        self.kept: list[dict] = []
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            path = run_dir / "metrics.jsonl"
            if resumed_at and path.is_file():
                rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                self.kept = [r for r in rows if r["step"] <= resumed_at]
            self._jsonl = path.open("w")
            self._csv_file = (run_dir / "metrics.csv").open("w", newline="")
            for row in self.kept:
                self.write(row)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        flat = {k: v for k, v in row.items() if not isinstance(v, (list, dict))}
        if self._csv is None and "loss" not in flat:
            self._waiting.append(flat)
            return
        if self._csv is None:
            names = list(flat) + [c for c in self._columns if c not in flat]
            self._csv = csv.DictWriter(self._csv_file, fieldnames=names, extrasaction="ignore")
            self._csv.writeheader()
            self._csv.writerows(self._waiting)
        self._csv.writerow(flat)
        self._csv_file.flush()

    def close(self) -> None:
        if self.enabled:
            if self._csv is None and self._waiting:  # no training row came: the evaluation rows alone
                self._csv = csv.DictWriter(self._csv_file, fieldnames=list(self._waiting[0]), extrasaction="ignore")
                self._csv.writeheader()
                self._csv.writerows(self._waiting)
            self._jsonl.close()
            self._csv_file.close()
