"""Optimizers and learning-rate schedules named in the config, with DeepSpeed's meanings.

DeepSpeed's "Adam" and "AdamW" both mean decoupled weight decay (AdamW) unless `adam_w_mode` is false,
and their `weight_decay` defaults to 0.0 (torch's AdamW defaults to 0.01): we keep DeepSpeed's meaning so a
DeepSpeed config gives the same numbers here.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch

from paratrain.config import ConfigError, OptimizerConfig, SchedulerConfig
from paratrain.config.params import check_optimizer_params, check_scheduler_params, optimizer_class
from paratrain.muon import Muon

# Which parameters Muon takes is decided when the groups are made (`paratrain.engine.muon_setup.muon_param_groups`).
MUON_GROUPING_KEYS = ("muon_names", "adamw_names")
# DeepSpeed's Muon config: lr and weight_decay shared by both halves, muon_lr / adam_lr overriding lr, betas and
# eps the Adam half's, ns_method its Newton-Schulz variant.
DEEPSPEED_MUON_KEYS = ("muon_lr", "adam_lr", "betas", "ns_method")


def muon_options(params: dict) -> tuple[dict, dict]:
    """(Muon's options, its AdamW part's) from an `optimizer.params` of type Muon: torch's names, `adamw` for the
    AdamW part; a config with DeepSpeed's keys (`DEEPSPEED_MUON_KEYS`) is read with DeepSpeed's meanings."""
    muon = {k: v for k, v in params.items() if k not in MUON_GROUPING_KEYS}
    adamw = dict(muon.pop("adamw", {}))
    if any(key in muon for key in DEEPSPEED_MUON_KEYS):
        for key in ("betas", "eps"):
            if key in muon:
                adamw.setdefault(key, muon.pop(key))
        for key in ("lr", "weight_decay"):
            if key in muon:
                adamw.setdefault(key, muon[key])
        if "adam_lr" in muon:
            adamw["lr"] = muon.pop("adam_lr")
        if "muon_lr" in muon:
            muon["lr"] = muon.pop("muon_lr")
        if muon.pop("ns_method", "standard") != "standard":
            raise ConfigError("config key 'optimizer.params.ns_method': paratrain runs torch's Newton-Schulz "
                              "iteration ('standard'); remove the key or set it to 'standard' (its dtype: ns_dtype)")
    if "ns_coefficients" in muon:
        muon["ns_coefficients"] = tuple(muon["ns_coefficients"])
    if "betas" in adamw:
        adamw["betas"] = tuple(adamw["betas"])
    return muon, adamw


def build_optimizer(config: OptimizerConfig, params: Iterable) -> torch.optim.Optimizer:
    params = list(params)
    check_optimizer_params(config.type, config.params)  # again: the params may have changed since loading
    kwargs = dict(config.params)
    if config.type.lower() == "muon":
        muon, adamw = muon_options(kwargs)
        return Muon(params, adamw=adamw, **muon)
    cls = optimizer_class(config.type, kwargs)
    if config.type.lower() in ("adam", "adamw"):
        kwargs.pop("adam_w_mode", None)
        kwargs.pop("torch_adam", None)
        kwargs.setdefault("weight_decay", 0.0)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    if _supports_fused(cls, params) and "foreach" not in kwargs:
        # One kernel over all tensors instead of a Python loop per parameter: 3x faster on CPU here,
        # the same arithmetic. Users can still pass "fused": false.
        kwargs.setdefault("fused", True)
    try:
        return cls(params, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"config key 'optimizer.params' does not fit {cls.__name__}: {exc}") from None


def _supports_fused(cls: type, params: list) -> bool:
    if cls not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        return False
    tensors = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else params
    devices = {t.device.type for t in tensors}
    dtypes = {t.dtype for t in tensors}
    return devices <= {"cpu", "cuda"} and dtypes <= {torch.float32, torch.float16, torch.bfloat16, torch.float64}


class _DeepSpeedSchedule(ABC):
    """Base of DeepSpeed's warm-up schedules: `step()` after every optimizer step sets each group's lr."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply(self.get_lr())

    def _apply(self, lrs: list[float]) -> list[float]:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        return lrs

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._last_lr = self._apply(self.get_lr())

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        self._last_lr = self._apply(self.get_lr())

    @abstractmethod
    def get_lr(self) -> list[float]:
        """The learning rate of each param group at `last_batch_iteration`."""


def _warmup_fraction(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    if warmup_type == "log":
        return math.log(step + 1) / math.log(warmup_num_steps)
    return step / warmup_num_steps


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> None:
    if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ConfigError(f"config key 'scheduler.params.warmup_num_steps' = {warmup_num_steps!r}: must be a "
                          f"positive integer")
    if warmup_type not in ("log", "linear"):
        raise ConfigError(f"config key 'scheduler.params.warmup_type' = {warmup_type!r}: use 'log' or 'linear'")


class WarmupLR(_DeepSpeedSchedule):
    """lr rises from warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then stays."""

    def __init__(self, optimizer, warmup_min_lr: float = 0.0, warmup_max_lr: float | None = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        _check_warmup(warmup_num_steps, warmup_type)
        groups = optimizer.param_groups
        self.min_lrs = [float(warmup_min_lr)] * len(groups)
        self.max_lrs = [g["lr"] for g in groups] if warmup_max_lr is None else [float(warmup_max_lr)] * len(groups)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float | None = None, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        return max(0.0, (self.total_num_steps - self.last_batch_iteration)
                   / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_DeepSpeedSchedule):
    """A ratio of each group's base lr: warm-up from warmup_min_ratio to 1, then cosine to cos_min_ratio."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        _check_warmup(warmup_num_steps, warmup_type)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def lr_ratio(self) -> float:
        step = self.last_batch_iteration
        if step < 0:
            return 0.0
        if step < self.warmup_num_steps:
            ratio = _warmup_fraction(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (step - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.lr_ratio()
        return [lr * ratio for lr in self.base_lrs]


DEEPSPEED_SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def build_scheduler(config: SchedulerConfig, optimizer: torch.optim.Optimizer):
    check_scheduler_params(config.type, config.params)  # also refuses an unknown type, by name
    cls = DEEPSPEED_SCHEDULES.get(config.type) or getattr(torch.optim.lr_scheduler, config.type)
    try:
        return cls(optimizer, **config.params)
    except TypeError as exc:
        raise ConfigError(f"config key 'scheduler.params' does not fit {config.type}: {exc}") from None
