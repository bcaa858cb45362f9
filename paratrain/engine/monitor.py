"""What users see while a job runs: DeepSpeed-style log lines and metric events (TensorBoard, CSV).

DeepSpeed's config keys drive it: `steps_per_print` (a log line every N optimizer steps),
`wall_clock_breakdown` (forward/backward/step/comm-wait times in that line), `tensorboard {enabled,
output_path, job_name}` and `csv_monitor {enabled, output_path, job_name}` (one event per optimizer step:
Train/Samples/train_loss, lr, grad_norm, loss_scale, with wall_clock_breakdown the elapsed_time_ms_* of the
step; the x-axis is the number of samples trained, as DeepSpeed's). Only global rank 0 writes.

A model with `paratrain.moe.MoELayer`s adds its routing of each optimizer step (`paratrain/moe/stats.py`,
summed over the data x context-parallel ranks): `moe_dropped_fraction`, `moe_aux_loss`, `moe_z_loss`,
`moe_load_max` / `moe_load_min` (an expert's tokens / the mean) as events and in the log line, and every
layer's tokens per expert as one JSON line per step in the CSV monitor's `moe_tokens.jsonl`.
"""

from __future__ import annotations

import csv
import json
import logging
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.config.outputs import CsvMonitorConfig, TensorboardConfig
from paratrain.moe.stats import RoutingStep, moe_layers, reduce_routing, take_routing

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


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
        self._routing = None  # moe_tokens.jsonl, opened at the first MoE step

    def write(self, events: list[tuple[str, float, int]]) -> None:
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
        if self._routing is not None:
            self._routing.close()


class Monitor:
    """Fan-out of per-step events to the enabled backends (none unless configured; rank 0 only)."""

    def __init__(self, tensorboard, csv_monitor, rank: int):
        self.backends = []
        if rank != 0:
            return
        # DeepSpeed's placement: output_path/job_name, relative to the working directory ("" = here).
        if tensorboard.enabled:
            directory = Path(tensorboard.output_path) / tensorboard.job_name
            try:
                self.backends.append(_TensorBoard(directory))
            except ImportError:
                log.warning("tensorboard.enabled is true but the tensorboard package is not installed "
                            "(pip install tensorboard); metrics go to the other monitors only")
        if csv_monitor.enabled:
            self.backends.append(_Csv(Path(csv_monitor.output_path) / csv_monitor.job_name))

    @property
    def enabled(self) -> bool:
        return bool(self.backends)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """(name, value, step) tuples, as DeepSpeed's engine.monitor.write_events takes them."""
        for backend in self.backends:
            backend.write(events)

    def write_routing(self, step: int, samples: int, routing: RoutingStep) -> None:
        """Every MoE layer's tokens per expert (the CSV monitor's moe_tokens.jsonl)."""
        for backend in self.backends:
            if hasattr(backend, "write_routing"):
                backend.write_routing(step, samples, routing)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


@dataclass(frozen=True)
class MonitorSettings:
    """What the step reporter reads: DeepSpeed's monitor sections, steps_per_print, wall_clock_breakdown, and
    whether fp16 loss scaling runs (its scale goes into the log line)."""

    tensorboard: TensorboardConfig
    csv_monitor: CsvMonitorConfig
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    fp16: bool = False


class StepReporter:
    """The engine's voice after each optimizer step: monitor events and, every `steps_per_print` steps, a
    DeepSpeed-style log line on rank 0 (step, skipped, lr, mom, loss scale, grad norm, samples/s, and with
    `wall_clock_breakdown` the mean forward/backward/step/comm-wait milliseconds per step since the last line).

    `train_loss` is the mean loss of this rank's micro-batches of the step (rank 0 writes; averaging over
    ranks would cost a collective per step). The engine hands in its losses; nothing is recorded unless a
    monitor is enabled.

    With MoE layers in `module`, the steps that report routing reduce it over `axis` (dp x cp): one small
    all_reduce (tag "metrics") and one host copy, on every rank: every step with a monitor on, every
    `steps_per_print` step, and every step once `wants_routing` is set (the trainer's per-step rows). Other
    steps only reset the layers' device totals (no host read); `routing` keeps the last reduced step's.
    Without MoE layers nothing is collected.
    """

    def __init__(self, settings: MonitorSettings, rank: int, module: torch.nn.Module | None = None, axis=None):
        self.rank0 = rank == 0
        self._moe = (module, axis) if module is not None and moe_layers(module) else None
        self.routing: RoutingStep | None = None
        self.wants_routing = False
        self.monitor = Monitor(settings.tensorboard, settings.csv_monitor, rank)
        self.every = settings.steps_per_print
        self.breakdown = settings.wall_clock_breakdown
        self.fp16 = settings.fp16
        self._losses: list[torch.Tensor] = []
        self._step_times: dict[str, float] = {}  # timings at the previous optimizer step
        self._print_times: dict[str, float] = {}  # ... and at the previous log line
        # Counted here, not from engine.global_steps / global_samples, which jump when a checkpoint is loaded.
        self._print_wall, self._steps_since_print = time.perf_counter(), 0

    def record_loss(self, loss: torch.Tensor) -> None:
        if self.monitor.enabled:
            self._losses.append(loss.detach())

    def after_step(self, engine) -> None:
        times = engine.timings()
        print_step = engine.global_steps % self.every == 0
        if self._moe is not None:  # the same steps on every rank: the reduction is a collective
            totals = take_routing(self._moe[0])
            if self.monitor.enabled or print_step or self.wants_routing:
                self.routing = reduce_routing(totals, self._moe[1])
        if self.monitor.enabled:
            self.monitor.write_events(self._events(engine, times))
            if self.routing is not None:
                self.monitor.write_routing(engine.global_steps, engine.global_samples, self.routing)
        self._step_times = times
        self._steps_since_print += 1
        if self.rank0 and print_step:
            log.info(self._line(engine, times))

    def _events(self, engine, times: dict[str, float]) -> list[tuple[str, float, int]]:
        x = engine.global_samples
        events = []
        if self._losses:
            events.append(("Train/Samples/train_loss", float(torch.stack(self._losses).float().mean()), x))
            self._losses.clear()
        events.append(("Train/Samples/lr", engine.get_lr()[0], x))
        if engine.get_global_grad_norm() is not None:
            events.append(("Train/Samples/grad_norm", engine.get_global_grad_norm(), x))
        if self.fp16:
            events.append(("Train/Samples/loss_scale", engine.loss_scale(), x))
        if self.breakdown:
            for phase, seconds in _delta(times, self._step_times).items():
                events.append((f"Train/Samples/elapsed_time_ms_{phase}", seconds * 1000.0, x))
        if self.routing is not None:
            events += [(f"Train/Samples/{name}", value, x) for name, value in self.routing.scalars().items()]
        return events

    def _line(self, engine, times: dict[str, float]) -> str:
        now, n = time.perf_counter(), max(self._steps_since_print, 1)
        rate = n * engine.train_batch_size() / max(now - self._print_wall, 1e-9)
        norm = engine.get_global_grad_norm()
        line = (f"step={engine.global_steps}, skipped={engine.skipped_steps}, lr={engine.get_lr()}, "
                f"mom={engine.get_mom()}, loss_scale={engine.loss_scale():g}, "
                f"grad_norm={'n/a' if norm is None else f'{norm:.4g}'}, samples/s={rate:.1f}")
        if self.routing is not None:
            r = self.routing
            line += (f", moe: dropped={r.dropped_fraction:.2%}, aux_loss={r.aux_loss:.4g}, z_loss={r.z_loss:.4g}, "
                     f"load max/min={r.load_max:.2f}/{r.load_min:.2f}")
        if self.breakdown:
            parts = " | ".join(f"{k}: {v * 1000.0 / n:.2f}" for k, v in _delta(times, self._print_times).items())
            line += f"\ntime (ms, mean per step over the last {n}) | {parts}"
        self._print_times = times
        self._print_wall, self._steps_since_print = now, 0
        return line

    def close(self) -> None:
        self.monitor.close()


def _delta(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in now.items()}
