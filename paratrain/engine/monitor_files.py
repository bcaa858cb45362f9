"""DeepSpeed's file monitors: TensorBoard event files and one CSV file per metric, written on global rank 0.

Both take DeepSpeed's events, `(name, value, step)` tuples (`write`), and named metrics at a step
(`log_metrics`, what `engine.log_metrics` sends: evaluation results, the trainer's throughput), which become
events under their own names. `paratrain/engine/monitor.py` fans out to them and to the experiment trackers.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from paratrain.moe.stats import RoutingStep

Events = list[tuple[str, float, int]]


class TensorBoardMonitor:
    name = "tensorboard"
    tracker = False  # DeepSpeed's events as they are (Train/Samples/..., x = samples)

    def __init__(self, directory: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(directory))

    def write(self, events: Events) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.write([(name, value, step) for name, value in metrics.items()])

    def close(self) -> None:
        self.writer.close()


class CsvMonitor:
    """One CSV file per metric, as DeepSpeed's csv_monitor writes them: step,value."""

    name = "csv_monitor"
    tracker = False

    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, tuple] = {}
        self._routing = None  # moe_tokens.jsonl, opened at the first MoE step

    def write(self, events: Events) -> None:
        for name, value, step in events:
            if name not in self._files:
                # DeepSpeed's naming: Train/Samples/lr -> Train_Samples_lr.csv with the header "step,lr"
                # Appended to, as DeepSpeed does, so a resumed job continues its curves.
                path = self.directory / (name.replace("/", "_").replace(" ", "_") + ".csv")
                fresh = not path.exists() or path.stat().st_size == 0
                handle = path.open("a", newline="")
                writer = csv.writer(handle)
                if fresh:
                    writer.writerow(["step", name.split("/")[-1]])
                self._files[name] = (handle, writer)
            handle, writer = self._files[name]
            writer.writerow([step, value])
            handle.flush()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.write([(name, value, step) for name, value in metrics.items()])

    def write_routing(self, step: int, samples: int, routing: RoutingStep) -> None:
        """One line per optimizer step: {step, samples, tokens: {layer: per-expert}, dropped: {layer: n}}."""
        if self._routing is None:  # appended to, like the CSV files
            self._routing = (self.directory / "moe_tokens.jsonl").open("a")
        row = routing.row()
        self._routing.write(json.dumps({"step": step, "samples": samples, "tokens": row["moe_tokens"],
                                        "dropped": row["moe_dropped"]}) + "\n")
        self._routing.flush()

    def close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files.clear()
        if self._routing is not None:
            self._routing.close()
            self._routing = None
