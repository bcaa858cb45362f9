"""What users see while a job runs: DeepSpeed-style log lines and metric events (TensorBoard, CSV, W&B, MLflow).

DeepSpeed's config keys drive it: `steps_per_print` (a log line every N optimizer steps),
`wall_clock_breakdown` (forward/backward/step/comm-wait times in that line), `tensorboard {enabled,
output_path, job_name}` and `csv_monitor {enabled, output_path, job_name}` (one event per optimizer step:
Train/Samples/train_loss, lr, grad_norm, loss_scale, with wall_clock_breakdown the elapsed_time_ms_* of the
step; the x-axis is the number of samples trained, as DeepSpeed's; `monitor_files.py`). The experiment
trackers, `wandb {enabled, team, group, project, mode, dir}` and `mlflow {enabled, tracking_uri,
experiment_name, run_name}` (`trackers.py`), get the same step's values under transformers' Trainer names
(train/loss, train/learning_rate, train/grad_norm, train/loss_scale, train/<other>, and train/samples) over
the optimizer step, and the resolved config. `engine.log_metrics` sends more (eval/loss) to every backend.
Only global rank 0 writes; a backend that fails is warned about once and dropped: it never stops training.

A model with `paratrain.moe.MoELayer`s adds its routing of each optimizer step (`paratrain/moe/stats.py`,
summed over the data x context-parallel ranks): `moe_dropped_fraction`, `moe_aux_loss`, `moe_z_loss`,
`moe_load_max` / `moe_load_min` (an expert's tokens / the mean) as events and in the log line, and every
layer's tokens per expert as one JSON line per step in the CSV monitor's `moe_tokens.jsonl`.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from paratrain.config import Config
from paratrain.config.outputs import CsvMonitorConfig, MlflowConfig, TensorboardConfig, WandbConfig
from paratrain.engine.monitor_files import CsvMonitor, TensorBoardMonitor
from paratrain.engine.trackers import MlflowTracker, WandbTracker
from paratrain.errors import InvalidValueError
from paratrain.moe.stats import RoutingStep, moe_layers, reduce_routing, take_routing

log = logging.getLogger("paratrain")

# The step reporter's scalars under the names transformers' Trainer gives them, for the experiment trackers;
# the others are train/<name> (train/grad_norm, train/loss_scale, train/moe_aux_loss, ...).
TRACKER_NAMES = {"train_loss": "train/loss", "lr": "train/learning_rate"}


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


class Monitor:
    """Fan-out of metrics to the enabled backends (none unless configured; rank 0 only). A backend that cannot
    start, or raises while writing, is warned about once by name and dropped: monitoring never stops training."""

    def __init__(self, tensorboard: TensorboardConfig, csv_monitor: CsvMonitorConfig, rank: int,
                 wandb: WandbConfig | None = None, mlflow: MlflowConfig | None = None,
                 run_config: Callable[[], dict] | None = None):
        self.backends: list = []
        self._closer: weakref.finalize | None = None
        self.enabled = False  # DeepSpeed's monitor.enabled: some backend started here (it stays so after close)
        if rank != 0:
            return
        run_config = run_config or dict  # read only when a tracker starts
        # DeepSpeed's placement: output_path/job_name, relative to the working directory ("" = here).
        if tensorboard.enabled:
            self._start("tensorboard", lambda: TensorBoardMonitor(Path(tensorboard.output_path) / tensorboard.job_name))
        if csv_monitor.enabled:
            self._start("csv_monitor", lambda: CsvMonitor(Path(csv_monitor.output_path) / csv_monitor.job_name))
        if wandb is not None and wandb.enabled:
            self._start("wandb", lambda: WandbTracker(wandb, run_config()))
        if mlflow is not None and mlflow.enabled:
            self._start("mlflow", lambda: MlflowTracker(mlflow, run_config()))
        self.enabled = bool(self.backends)
        if self.enabled:  # closed (files flushed, the W&B / MLflow runs finished) by close(), else at exit
            self._closer = weakref.finalize(self, _close_all, self.backends, True)

    def _start(self, name: str, make: Callable) -> None:
        try:
            self.backends.append(make())
        except ImportError as error:
            log.warning("%s.enabled is true but the %s package cannot be imported (%s); install it with `pip install "
                        "%s`; metrics go to the other monitors only", name, name, error, name)
        except Exception as error:  # any failure of a monitor: training goes on without it
            log.warning("%s could not start (%s: %s); training continues without it", name,
                        type(error).__name__, error)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """(name, value, step) tuples, as DeepSpeed's engine.monitor.write_events takes them; trackers get each
        step's values at that step."""
        _each(self.backends, lambda backend: backend.write(events))

    def write_step(self, scalars: dict[str, float], samples: int, step: int) -> None:
        """One optimizer step's scalars: DeepSpeed's events (Train/Samples/<name>, x = samples trained) to the
        file monitors, transformers' names at the optimizer step (and train/samples) to the trackers."""
        events = [(f"Train/Samples/{name}", value, samples) for name, value in scalars.items()]
        metrics = {TRACKER_NAMES.get(name, f"train/{name}"): value for name, value in scalars.items()}
        metrics["train/samples"] = samples
        _each(self.backends, lambda backend: backend.log_metrics(metrics, step) if backend.tracker
              else backend.write(events))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Named values at an optimizer step (eval/loss, ...) to every backend: trackers at that step, the file
        monitors as events `(name, value, step)`. Checked on every rank, so a bad value fails the same everywhere."""
        numbers = {}
        for name, value in metrics.items():
            try:
                numbers[name] = float(value)
            except (TypeError, ValueError, RuntimeError):
                raise InvalidValueError(f"log_metrics: {name!r} is {value!r}, not a number; pass floats, ints or "
                                        f"one-element tensors") from None
        _each(self.backends, lambda backend: backend.log_metrics(numbers, step))

    def write_routing(self, step: int, samples: int, routing: RoutingStep) -> None:
        """Every MoE layer's tokens per expert (the CSV monitor's moe_tokens.jsonl)."""
        _each([b for b in self.backends if hasattr(b, "write_routing")],
              lambda backend: backend.write_routing(step, samples, routing), self.backends)

    def close(self) -> None:
        """Flush and close every backend (finish the runs); later writes are dropped. Safe to call twice."""
        if self._closer is not None and self._closer.detach() is not None:
            _close_all(self.backends)


def _each(backends: list, call: Callable, owner: list | None = None) -> None:
    """`call(backend)` for each backend; one that raises is warned about once and dropped from `owner`."""
    owner = backends if owner is None else owner
    for backend in list(backends):
        try:
            call(backend)
        except Exception as error:  # a monitor never stops training
            owner.remove(backend)
            log.warning("%s failed (%s: %s) and is dropped; training continues without it", backend.name,
                        type(error).__name__, error)
            with contextlib.suppress(Exception):  # it has failed once already; its one warning is out
                backend.close()  # keep what it has written so far


def _close_all(backends: list, at_exit: bool = False) -> None:
    """Close every backend. One that fails is named (what it wrote is kept); at exit (after Ctrl-C, an error, or a
    script that never closed) quietly: a tracker whose service the signal also stopped fails there as a matter of
    course, and the job is ending, not continuing without it."""
    for backend in backends:
        try:
            backend.close()
        except Exception as error:
            log.log(logging.DEBUG if at_exit else logging.WARNING, "%s failed while closing (%s: %s)", backend.name,
                    type(error).__name__, error)
    backends.clear()


@dataclass(frozen=True)
class MonitorSettings:
    """What the step reporter reads: DeepSpeed's monitor sections, the trackers' sections and the config they
    record (read when one starts), steps_per_print, wall_clock_breakdown, and whether fp16 loss scaling runs (its
    scale goes into the log line)."""

    tensorboard: TensorboardConfig
    csv_monitor: CsvMonitorConfig
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    fp16: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    run_config: Callable[[], dict] = dict

    @classmethod
    def of(cls, config: Config) -> MonitorSettings:
        return cls(config.tensorboard, config.csv_monitor, config.steps_per_print, config.wall_clock_breakdown,
                   config.fp16.enabled, config.wandb, config.mlflow, lambda: config.model_dump(mode="json"))


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
        self.monitor = Monitor(settings.tensorboard, settings.csv_monitor, rank, settings.wandb, settings.mlflow,
                               settings.run_config)
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
            self.monitor.write_step(self._scalars(engine, times), engine.global_samples, engine.global_steps)
            if self.routing is not None:
                self.monitor.write_routing(engine.global_steps, engine.global_samples, self.routing)
        self._step_times = times
        self._steps_since_print += 1
        if self.rank0 and print_step:
            log.info(self._line(engine, times))

    def _scalars(self, engine, times: dict[str, float]) -> dict[str, float]:
        """The step's values by DeepSpeed's event names (Train/Samples/<name>); `Monitor.write_step` names
        them for each backend."""
        scalars = {}
        if self._losses:
            scalars["train_loss"] = float(torch.stack(self._losses).float().mean())
            self._losses.clear()
        scalars["lr"] = engine.get_lr()[0]
        if engine.get_global_grad_norm() is not None:
            scalars["grad_norm"] = engine.get_global_grad_norm()
        if self.fp16:
            scalars["loss_scale"] = engine.loss_scale()
        if self.breakdown:
            for phase, seconds in _delta(times, self._step_times).items():
                scalars[f"elapsed_time_ms_{phase}"] = seconds * 1000.0
        if self.routing is not None:
            scalars |= self.routing.scalars()
        return scalars

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
