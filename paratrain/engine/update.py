"""One optimizer update at an accumulation boundary, after the strategy has finished reducing gradients:

    global gradient norm -> fp16: unscale, or skip an overflowing step -> bf16/fp32: stop or skip on NaN/inf
    -> divide by the ranks averaged over, unscale and clip in one pass -> optimizer step -> LR schedule -> zero
    gradients

The strategy leaves its reduced gradients summed (`GradSync.gradient_divisor`): the average's division joins
the one scaling pass a step already makes for the token count, the loss scale or clipping, instead of a pass
of its own over every gradient.

The norm is the same number on every rank (`paratrain.grad_norm`), so every rank takes the same branch.
The norm, the clip factor and the token-weighted scale stay device tensors: the host reads the norm only to
choose a branch (fp16's loss scaler, `nonfinite_loss` "stop"/"skip"); with "stop_at_log" a bf16/fp32 step
reads nothing, and the first NaN/inf step is recorded on the device and raised at the next log step or save.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from paratrain.grad_norm import clip_factor, global_grad_norm
from paratrain.layout.mesh import Mesh
from paratrain.parallel.dp.base import GradSync
from paratrain.precision import LossScaler, NonFiniteLossError

log = logging.getLogger("paratrain")


@dataclass(frozen=True)
class Update:
    """What an update did: the global gradient norm before clipping (unscaled, a device tensor: read it only
    when it is logged), and why it was skipped (None when the optimizer stepped)."""

    norm: torch.Tensor
    skipped: str | None = None


class FirstNonFinite:
    """The first step whose global gradient norm was NaN/inf (0: none yet), kept on the device so recording
    it costs no host read; `check()` reads it (at a log step, before a save)."""

    def __init__(self, device: torch.device):
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self.norm = torch.zeros((), dtype=torch.float64, device=device)

    def record(self, norm: torch.Tensor, step: int) -> None:
        first = (self.step == 0) & ~torch.isfinite(norm)
        self.step = torch.where(first, step, self.step)
        self.norm = torch.where(first, norm, self.norm)

    def check(self) -> None:
        step = int(self.step)
        if step:
            raise NonFiniteLossError.late(step, float(self.norm))


class OptimizerUpdate:
    def __init__(self, grad_sync: GradSync, mesh: Mesh, device: torch.device, loss_scaler: LossScaler | None,
                 nonfinite_loss: str, check_every: int = 1):
        self.grad_sync = grad_sync
        self.mesh = mesh
        self.device = device
        self.loss_scaler = loss_scaler
        self.nonfinite_loss = nonfinite_loss
        self.first_nonfinite = FirstNonFinite(device)
        self.check_every = check_every  # "stop_at_log": read the record every steps_per_print steps
        # DDP over a world that is all data parallelism, without experts split over it: every rank holds the
        # whole gradient (the norm needs no collective, as torch DDP's clip_grad_norm_ needs none)
        self.norm_is_local = not grad_sync.shards_gradients and mesh.size("dp_cp") == mesh.world_size \
            and mesh.expert_axes() is None

    def __call__(self, lr_scheduler, max_norm: float, step: int,
                 grad_scale: torch.Tensor | float = 1.0) -> Update:
        """Update once (collective). `step` is the number this step will have, for the error message;
        `grad_scale` multiplies the gradients first (the token-weighted loss's division by the global count,
        `paratrain.engine.token_loss`), in the same pass as the data-parallel average's division, the unscaling
        and the clipping."""
        sync = self.grad_sync
        norm = global_grad_norm(sync.grad_pieces(), self.mesh, self.device, self.norm_is_local)
        if sync.gradient_divisor != 1.0:  # the average's division, folded into this pass (GradSync.gradient_divisor)
            grad_scale = grad_scale / sync.gradient_divisor
        norm = norm * grad_scale
        factor = grad_scale  # a host float until something on the device (the token count, clipping) joins it
        if self.loss_scaler is not None:
            # A non-finite norm means some gradient on some rank overflowed: every rank skips the same step.
            scale = self.loss_scaler.scale
            overflow = not math.isfinite(float(norm))
            self.loss_scaler.update(overflow)
            if overflow:
                return self._skip(norm, f"fp16 gradients overflowed (loss scale now {self.loss_scaler.scale:g})")
            norm, factor = norm / scale, factor / scale
        elif self.nonfinite_loss == "stop_at_log":
            self.first_nonfinite.record(norm, step)
        elif not math.isfinite(value := float(norm)):
            if self.nonfinite_loss == "skip":
                return self._skip(norm, f"the global gradient norm is {value} (the loss or a gradient is NaN/inf)")
            error = NonFiniteLossError.at(step, value)
            if self.mesh.rank == 0:
                log.error(str(error))
            raise error
        if max_norm > 0.0:
            factor = clip_factor(norm, max_norm) * factor
        if isinstance(factor, torch.Tensor) or factor != 1.0:  # a device factor is applied unread
            sync.scale_gradients(factor)  # unscale and clip in one pass
        sync.optimizer_step()
        if lr_scheduler is not None:
            lr_scheduler.step()
        sync.zero_grad()
        if self.nonfinite_loss == "stop_at_log" and step % self.check_every == 0:
            self.first_nonfinite.check()
        return Update(norm)

    def check_nonfinite(self) -> None:
        """With "stop_at_log": raise if a step's norm was NaN/inf (reads the device; before a save)."""
        if self.nonfinite_loss == "stop_at_log":
            self.first_nonfinite.check()

    def _skip(self, norm: torch.Tensor, reason: str) -> Update:
        """No update and no LR step (DeepSpeed's behaviour on an fp16 overflow); the step still counts."""
        self.grad_sync.zero_grad()
        return Update(norm, reason)
