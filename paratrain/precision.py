"""Mixed precision: the compute dtype of each precision and DeepSpeed's fp16 loss scaling.

bf16 and fp16 both mean: the model's parameters, activations and gradients (and the gradient
communication) are in the low-precision dtype; master weights and optimizer states are fp32 and belong to
the data-parallel strategy (`parallel/dp/zero.py`, `fsdp.py`), which casts the master into the model
after every step. Only fp16 needs a loss scale: its 5-bit exponent underflows small gradients, so the loss
is multiplied by a large scale before backward and the gradients are divided by it before the update.

[Note: the dynamic loss scale follows DeepSpeed exactly]
`DynamicLossScaler.update` is DeepSpeed's `DynamicLossScaler.update_scale`
(deepspeed/runtime/fp16/loss_scaler.py): on an overflow the step is skipped and, once `hysteresis`
overflows have been absorbed, the scale is halved (not below `min_loss_scale`); an overflow at the minimum
scale is fatal. After `loss_scale_window` iterations without an overflow the scale doubles (and the
hysteresis refills). The engine skips the optimizer step and the LR schedule on an overflow, as
DeepSpeed's engine does.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from paratrain.errors import Error, InvalidValueError

log = logging.getLogger("paratrain")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype of parameters, activations and gradient communication for a precision name."""
    try:
        return DTYPES[precision]
    except KeyError:
        raise InvalidValueError(f"unknown precision {precision!r}; use one of {', '.join(DTYPES)}") from None


def autocast_context(enabled: bool, device: torch.device):
    """A factory of the forward's autocast context (torch_autocast): bf16 matmuls and convolutions with fp32
    parameters, or nothing."""
    if not enabled:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


class LossScaleError(Error, RuntimeError):
    """An fp16 overflow at the minimum loss scale: training cannot continue."""

    exit_code = 1  # the run failed, not its input


class NonFiniteLossError(Error, RuntimeError):
    """bf16/fp32 with `nonfinite_loss: "stop"` or "stop_at_log": the loss or a gradient became NaN/inf."""

    exit_code = 1  # the run failed, not its input

    @classmethod
    def at(cls, step: int, norm: float) -> NonFiniteLossError:
        return cls(f"step {step}: the global gradient norm is {norm}: the loss or a gradient became NaN/inf on some "
                   f"rank, and nothing was updated. Lower the learning rate, enable gradient_clipping, check the "
                   f"data, or set nonfinite_loss to \"skip\" to skip such steps")

    @classmethod
    def late(cls, step: int, norm: float) -> NonFiniteLossError:
        """`nonfinite_loss: "stop_at_log"`: found at a log step or save, after that step's update."""
        return cls(f"step {step}: the global gradient norm was {norm}: the loss or a gradient became NaN/inf on some "
                   f"rank. With nonfinite_loss \"stop_at_log\" (no host read per step) that update and the ones "
                   f"after it were applied, so the parameters are no longer finite and nothing was saved: resume from "
                   f"the last checkpoint with a lower learning rate, gradient_clipping or fixed data, or set "
                   f"nonfinite_loss to \"stop\" to stop before the update")


class LossScaler:
    """A static loss scale (fp16.loss_scale > 0). An overflowing step is still skipped, never applied."""

    dynamic = False

    def __init__(self, scale: float):
        self.scale = float(scale)
        self.overflows = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.overflows += 1
            log.warning("fp16 overflow: skipping this step (static loss scale %g)", self.scale)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.overflows = state["scale"], state["overflows"]


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scale: halve on overflow (after hysteresis), double after a clean window."""

    dynamic = True

    def __init__(self, initial_scale: float, window: int = 1000, min_scale: float = 1.0, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, factor: float = 2.0):
        super().__init__(initial_scale)
        self.window = window
        self.min_scale = float(min_scale)
        self.hysteresis = hysteresis
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.factor = factor
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            self.overflows += 1
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.scale == self.min_scale:
                    raise LossScaleError(
                        f"fp16 gradients overflowed at the minimum loss scale ({self.min_scale:g}); the model "
                        f"diverged or its values exceed fp16's range. Lower the learning rate, enable "
                        f"gradient_clipping, lower fp16.min_loss_scale, or train in bf16 (bf16.enabled: true)")
                new_scale = max(self.scale / self.factor, self.min_scale)
                log.warning("fp16 overflow: skipping this step; loss scale %g -> %g", self.scale, new_scale)
                self.scale = new_scale
            else:
                log.warning("fp16 overflow: skipping this step; loss scale stays %g (hysteresis %d -> %d)",
                            self.scale, self.cur_hysteresis, self.cur_hysteresis - 1)
                self.cur_hysteresis -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable = self.iteration - self.last_overflow_iteration - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= self.factor
        self.iteration += 1

    def state_dict(self) -> dict:
        return {**super().state_dict(), "cur_hysteresis": self.cur_hysteresis, "iteration": self.iteration,
                "last_overflow_iteration": self.last_overflow_iteration}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.cur_hysteresis = state["cur_hysteresis"]
        self.iteration = state["iteration"]
        self.last_overflow_iteration = state["last_overflow_iteration"]


def make_loss_scaler(fp16) -> LossScaler | None:
    """The scaler the config's fp16 section asks for (None when fp16 is off: fp32 and bf16 need no scaling)."""
    if not fp16.enabled:
        return None
    if fp16.loss_scale > 0:
        return LossScaler(fp16.loss_scale)
    return DynamicLossScaler(2.0 ** fp16.initial_scale_power, window=fp16.loss_scale_window,
                             min_scale=fp16.min_loss_scale, hysteresis=fp16.hysteresis,
                             consecutive_hysteresis=fp16.consecutive_hysteresis)
