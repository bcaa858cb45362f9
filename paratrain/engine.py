"""The training engine: DeepSpeed's forward / backward / step contract over any parallel layout.

    engine, optimizer, loader, scheduler = paratrain.initialize(model=model, config="ds_config.json")
    for batch in loader:                 # or: loss = engine.train_batch()
        loss = engine(*batch)
        engine.backward(loss)            # scales by 1/gradient_accumulation_steps
        engine.step()                    # steps the optimizer only at the accumulation boundary

The engine knows strategies only through `parallelize`: gradient synchronization, sharding and the update
belong to the `GradSync` it returns.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

import paratrain.comm as comm
from paratrain.compat.engine_api import DeepSpeedEngineAPI, check_eval_arguments
from paratrain.config import Config
from paratrain.data.batch_check import BatchChecker
from paratrain.distributed import current_device
from paratrain.engine_setup import make_loader, make_scheduler, optimizer_factory, param_groups
from paratrain.engine_state import EngineStateAPI
from paratrain.grad_norm import global_grad_norm
from paratrain.mesh import Mesh
from paratrain.monitor import StepReporter, setup_logging
from paratrain.parallelize import parallelize
from paratrain.precision import NonFiniteLossError, make_loss_scaler

log = logging.getLogger("paratrain")


class Engine(EngineStateAPI, DeepSpeedEngineAPI):
    """DeepSpeed's engine contract. Checkpoints and introspection live in `engine_state.py`, construction
    helpers in `engine_setup.py`, the accessors DeepSpeed scripts use in `compat/engine_api.py`."""

    def __init__(self, model: nn.Module, config: Config, mesh: Mesh, optimizer=None, lr_scheduler=None,
                 model_parameters=None, training_data=None, collate_fn=None):
        self.config = config
        self.pmesh = mesh
        setup_logging(mesh.rank)
        if mesh.guard is not None:  # every collective below waits at most comm.timeout_s, then reports
            mesh.guard.configure(timeout_s=config.comm.timeout_s, report_dir=config.comm.report_dir or ".")
        self.device = current_device()
        self.parallel = parallelize(model, mesh, config, device=self.device)
        self.module = self.parallel.module
        self.grad_sync = self.parallel.grad_sync
        self.pipeline = self.parallel.pipeline  # set when pipeline.stages > 1: whole steps only
        self._autocast = self.parallel.autocast
        self.optimizer = self.grad_sync.build_optimizer(optimizer_factory(config, optimizer),
                                                        param_groups(model_parameters))
        self.lr_scheduler = make_scheduler(config, self.optimizer, lr_scheduler)
        self.training_dataloader = make_loader(self, training_data, collate_fn) if training_data is not None \
            else None
        self._data_iter = None
        self.global_steps = 0
        self.micro_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.loss_scaler = make_loss_scaler(config)  # fp16 only
        self._grad_norm: float | None = None
        self._times: dict[str, float] = defaultdict(float)
        self._window_micro_steps = 0  # micro-steps taken in the current accumulation window
        self._step_applied = False
        self._reporter = StepReporter(config, mesh.rank)
        self.monitor = self._reporter.monitor  # DeepSpeed's engine.monitor (write_events, enabled)
        self._check_train_batch = BatchChecker(config.batch_check, "training")
        self._check_eval_batch = BatchChecker(config.batch_check, "evaluation")
        self.auto_resumed: tuple[str, dict] | None = None  # (path, client_state) when initialize() resumed

    # ---- state of the step ----------------------------------------------------------------------
    @property
    def mesh(self):
        """The torch DeviceMesh with axes dp, pp, cp, tp (size-1 axes included)."""
        return self.pmesh.device_mesh

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._micro_steps_in_window() + 1 == self.gradient_accumulation_steps()

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    @contextmanager
    def no_sync(self):
        """Skip gradient synchronization for the backwards inside (the user accumulates by hand)."""
        with self.grad_sync.no_sync():
            yield

    # ---- the step contract -----------------------------------------------------------------------
    @contextmanager
    def _timed(self, name: str):
        if getattr(self, "destroyed", False):  # every forward, backward, step and pipeline step passes here
            raise RuntimeError(f"engine.{name}: engine.destroy() was called, which freed its process groups; "
                               f"build a new engine with paratrain.initialize")
        start = time.perf_counter()
        try:
            yield
        finally:
            self._times[name] += time.perf_counter() - start

    def _not_in_pipeline(self, what: str) -> None:
        if self.pipeline is not None:
            raise RuntimeError(f"engine.{what} is not available with pipeline.stages > 1: a pipeline runs whole "
                               f"steps of micro-batches; call engine.train_batch(data_iter) or "
                               f"engine.eval_batch(data_iter) (DeepSpeed's PipelineEngine does the same)")

    def forward(self, *inputs, **kwargs):
        self._not_in_pipeline("forward()")
        with self._timed("forward"), self._autocast():
            return self.module(*inputs, **kwargs)

    __call__ = forward

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        if loss.dim() != 0:
            raise ValueError(f"engine.backward expects a scalar loss, got shape {tuple(loss.shape)}; reduce it "
                             f"(e.g. loss.mean()) first")
        self._not_in_pipeline("backward()")
        self._reporter.record_loss(loss)
        scaled = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.scale
        self.grad_sync.prepare_backward(sync=self.is_gradient_accumulation_boundary())
        with self._timed("backward"):
            scaled.backward(retain_graph=retain_graph)

    def step(self) -> None:
        """Called after every backward; updates the model only at the accumulation boundary."""
        self._not_in_pipeline("step()")
        boundary = self.is_gradient_accumulation_boundary()
        skipped = self.skipped_steps
        if boundary:
            with self._timed("step"):
                self._optimizer_update()
        self._step_applied = boundary and self.skipped_steps == skipped
        self.micro_steps += 1
        self._window_micro_steps = 0 if boundary else self._window_micro_steps + 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.pmesh.size("dp")
        if boundary:
            self._reporter.after_step(self)
            self._save_if_due()

    def _optimizer_update(self) -> None:
        with self._timed("comm_wait"):
            self.grad_sync.finish_gradients()
        norm = global_grad_norm(self.grad_sync.grad_pieces(), self.pmesh, self.grad_sync.axis,
                                self.grad_sync.shards_gradients, self.device)
        factor = 1.0
        if self.loss_scaler is not None:
            # A non-finite norm means some gradient on some rank overflowed: every rank sees the same
            # norm, so every rank skips the same step.
            scale = self.loss_scaler.scale
            overflow = not math.isfinite(norm)
            self.loss_scaler.update(overflow)
            if overflow:
                self._skip_step(norm)
                return
            norm, factor = norm / scale, 1.0 / scale
        elif not math.isfinite(norm):
            self._nonfinite(norm)
            return
        self._grad_norm = norm
        clip = self.gradient_clipping()
        if clip > 0.0:
            coef = clip / (norm + 1e-6)
            if coef < 1.0:
                factor *= coef
        if factor != 1.0:
            self.grad_sync.scale_gradients(factor)  # unscale and clip in one pass
        self.grad_sync.optimizer_step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.grad_sync.zero_grad()
        self.global_steps += 1

    def _nonfinite(self, norm: float) -> None:
        """bf16/fp32: a NaN/inf loss or gradient. The norm is the same number on every rank, so every rank
        stops, or skips, at the same step."""
        if self.config.nonfinite_loss == "skip":
            self._skip_step(norm, f"the global gradient norm is {norm} (the loss or a gradient is NaN/inf)")
            return
        error = NonFiniteLossError.at(self.global_steps + 1, norm)
        if self.global_rank == 0:
            log.error(str(error))
        raise error

    def _skip_step(self, norm: float, reason: str | None = None) -> None:
        """No update and no LR step (DeepSpeed's behaviour on an fp16 overflow); the step still counts."""
        self._grad_norm = norm
        self.grad_sync.zero_grad()
        self.skipped_steps += 1
        self.global_steps += 1
        if self.global_rank == 0:
            reason = reason or f"fp16 gradients overflowed (loss scale now {self.loss_scale():g})"
            log.warning("step %d skipped: %s (skipped_steps=%d)", self.global_steps, reason, self.skipped_steps)

    def _run_micro_batch(self, batch) -> torch.Tensor:
        batch = self._checked(batch, self._check_train_batch if self.module.training else self._check_eval_batch)
        if isinstance(batch, dict):
            return self(**batch)
        if isinstance(batch, (tuple, list)):
            return self(*batch)
        return self(batch)

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Run one global batch (every micro-batch of this rank), step, and return the global mean loss."""
        if data_iter is None:
            if self.training_dataloader is None:
                raise ValueError("train_batch() needs data_iter= or training_data= passed to initialize()")
            data_iter = self.training_dataloader
        if self.pipeline is not None:
            return self._train_pipeline(data_iter)
        total = torch.zeros((), dtype=torch.float32, device=self.device)  # no host sync per micro-batch
        for _ in range(self.gradient_accumulation_steps()):
            loss = self._run_micro_batch(next(data_iter))
            self.backward(loss)
            self.step()
            total += loss.detach().float()
        return self._mean_over_dp(total / self.gradient_accumulation_steps())

    @torch.no_grad()
    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> torch.Tensor:
        """Mean loss over `num_micro_batches` (default: gradient_accumulation_steps) without updating.
        DeepSpeed's PipelineEngine signature; only its defaults are supported (the loss, averaged)."""
        check_eval_arguments(return_logits, compute_loss, reduce_output, bcast_loss)
        was_training = self.module.training
        self.module.eval()
        count = num_micro_batches or self.gradient_accumulation_steps()
        if self.pipeline is not None:
            batches = [self._checked(next(data_iter), self._check_eval_batch) for _ in range(count)]
            mean = self.pipeline.eval_step(batches)
        else:
            total = torch.zeros((), dtype=torch.float32, device=self.device)
            for _ in range(count):
                total += self._run_micro_batch(next(data_iter)).float()
            mean = total / count
        self.module.train(was_training)
        return self._mean_over_dp(mean)

    def _train_pipeline(self, data_iter) -> torch.Tensor:
        """Every rank of a dp replica draws the same micro-batches; the first stage uses the inputs, the last
        the targets. The runner accumulates the step's gradients; the update is the engine's as always."""
        count = self.gradient_accumulation_steps()
        batches = [self._checked(next(data_iter), self._check_train_batch) for _ in range(count)]
        with self._timed("pipeline"):
            mean = self.pipeline.train_step(batches)
        self._reporter.record_loss(mean)
        skipped = self.skipped_steps
        with self._timed("step"):
            self._optimizer_update()
        self._step_applied = self.skipped_steps == skipped
        self.micro_steps += count
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.pmesh.size("dp") * count
        self._reporter.after_step(self)
        self._save_if_due()
        return self._mean_over_dp(mean)

    def _checked(self, batch, check: BatchChecker):
        check(batch)
        return _to_device(batch, self.device)

    def pipeline_timeline(self) -> dict | None:
        """The last step's executed actions with start/end times on every rank (collective over the world;
        None without a pipeline). `paratrain report` renders it."""
        return None if self.pipeline is None else self.pipeline.gather_timeline()

    def _mean_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        axis = self.pmesh.axis(("dp", "cp"))
        comm.all_reduce(value, axis, tag="metrics")
        return value / axis.size


def _to_device(batch, device: torch.device):
    return tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), batch)
