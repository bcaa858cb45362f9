"""One optimizer update at an accumulation boundary, after the strategy has finished reducing gradients:

    global gradient norm -> fp16: unscale, or skip an overflowing step -> bf16/fp32: stop or skip on NaN/inf
    -> clip (one pass with the unscaling) -> optimizer step -> LR schedule -> zero gradients

The norm is the same number on every rank (`paratrain.grad_norm`), so every rank takes the same branch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from paratrain.data_parallel.base import GradSync
from paratrain.grad_norm import clip_factor, global_grad_norm
from paratrain.mesh import Mesh
from paratrain.precision import LossScaler, NonFiniteLossError

log = logging.getLogger("paratrain")


@dataclass(frozen=True)
class Update:
    """What an update did: the global gradient norm before clipping (unscaled), and why it was skipped
    (None when the optimizer stepped)."""

    norm: float
    skipped: str | None = None


class OptimizerUpdate:
    def __init__(self, grad_sync: GradSync, mesh: Mesh, device: torch.device, loss_scaler: LossScaler | None,
                 nonfinite_loss: str):
        self.grad_sync = grad_sync
        self.mesh = mesh
        self.device = device
        self.loss_scaler = loss_scaler
        self.nonfinite_loss = nonfinite_loss

    def __call__(self, lr_scheduler, max_norm: float, step: int, grad_scale: float = 1.0) -> Update:
        """Update once (collective). `step` is the number this step will have, for the error message;
        `grad_scale` multiplies the averaged gradients first (the token-weighted loss's division by the global
        count, `paratrain.token_loss`), in the same pass as the unscaling and clipping."""
        sync = self.grad_sync
        norm = global_grad_norm(sync.grad_pieces(), self.mesh, sync.axis, sync.shards_gradients, self.device)
        norm *= grad_scale
        factor = grad_scale
        if self.loss_scaler is not None:
            # A non-finite norm means some gradient on some rank overflowed: every rank skips the same step.
            scale = self.loss_scaler.scale
            overflow = not math.isfinite(norm)
            self.loss_scaler.update(overflow)
            if overflow:
                return self._skip(norm, f"fp16 gradients overflowed (loss scale now {self.loss_scaler.scale:g})")
            norm, factor = norm / scale, 1.0 / scale
        elif not math.isfinite(norm):
            if self.nonfinite_loss == "skip":
                return self._skip(norm, f"the global gradient norm is {norm} (the loss or a gradient is NaN/inf)")
            error = NonFiniteLossError.at(step, norm)
            if self.mesh.rank == 0:
                log.error(str(error))
            raise error
        factor *= clip_factor(norm, max_norm)
        if factor != 1.0:
            sync.scale_gradients(factor)  # unscale and clip in one pass
        sync.optimizer_step()
        if lr_scheduler is not None:
            lr_scheduler.step()
        sync.zero_grad()
        return Update(norm)

    def _skip(self, norm: float, reason: str) -> Update:
        """No update and no LR step (DeepSpeed's behaviour on an fp16 overflow); the step still counts."""
        self.grad_sync.zero_grad()
        return Update(norm, reason)
