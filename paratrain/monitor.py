"""What users see while a job runs: DeepSpeed-style log lines and metric events (TensorBoard, CSV).

DeepSpeed's config keys drive it: `steps_per_print` (a log line every N optimizer steps),
`wall_clock_breakdown` (forward/backward/step/comm-wait times in that line), `tensorboard {enabled,
output_path, job_name}` and `csv_monitor {enabled, output_path, job_name}` (one event per optimizer step:
Train/Samples/train_loss, lr, grad_norm, loss_scale). Only global rank 0 writes.
"""

from __future__ import annotations

import csv
import logging
import sys
from pathlib import Path

log = logging.getLogger("paratrain")


def setup_logging(rank: int) -> logging.Logger:
    """Give the `paratrain` logger a stdout handler on rank 0 unless the application configured one."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(f"[paratrain rank {rank}] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        log.propagate = False
    return log


class _TensorBoard:
    def __init__(self, directory: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(directory))

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Csv:
    """One CSV file per metric, as DeepSpeed's csv_monitor writes them: step,value."""

    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, tuple] = {}

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            if name not in self._files:
                handle = (self.directory / (name.replace("/", "_") + ".csv")).open("w", newline="")
                writer = csv.writer(handle)
                writer.writerow(["step", name])
                self._files[name] = (handle, writer)
            handle, writer = self._files[name]
            writer.writerow([step, value])
            handle.flush()

    def close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()


class Monitor:
    """Fan-out of per-step events to the enabled backends (none unless configured; rank 0 only)."""

    def __init__(self, tensorboard, csv_monitor, rank: int):
        self.backends = []
        if rank != 0:
            return
        if tensorboard.enabled:
            directory = Path(tensorboard.output_path or "runs") / tensorboard.job_name
            try:
                self.backends.append(_TensorBoard(directory))
            except ImportError:
                log.warning("tensorboard.enabled is true but the tensorboard package is not installed "
                            "(pip install tensorboard); metrics go to the other monitors only")
        if csv_monitor.enabled:
            self.backends.append(_Csv(Path(csv_monitor.output_path or "runs") / csv_monitor.job_name))

    @property
    def enabled(self) -> bool:
        return bool(self.backends)

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for backend in self.backends:
            backend.write(events)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
