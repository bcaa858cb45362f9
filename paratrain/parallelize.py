"""The one place that applies parallel strategies to a model, in a fixed order, from the config.

Order (each step sees the result of the previous one):
  1. tensor parallel plan (swap/shard modules over the tp axis)
  2. pipeline split (keep this rank's stage over the pp axis)
  3. context parallel (ring attention over the cp axis)
  4. activation checkpointing
  5. data parallel: DDP or a ZeRO stage over the dp (x cp) axis
The engine only sees the returned `ParallelModel`; it never imports a strategy folder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from paratrain.config import Config, ConfigError
from paratrain.context_parallel import check_context_parallel, context_parallelize
from paratrain.data_parallel.base import GradSync
from paratrain.data_parallel.ddp import DistributedDataParallel
from paratrain.mesh import Mesh
from paratrain.tensor_parallel import parallelize as tensor_parallelize
from paratrain.tensor_parallel.plan import check_plan_syntax


@dataclass
class ParallelModel:
    """What parallelize produces: the local module and the strategy that synchronizes its gradients.

    `unshard` undoes the model-parallel steps for `full_state_dict`: the data-parallel strategy first
    gives this rank's module state with ZeRO shards gathered, then each function (added by the TP, PP, ...
    steps, in the order they are to be undone) turns it into the state of the original model.
    """

    module: nn.Module
    grad_sync: GradSync
    unshard: list[Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = self.grad_sync.full_state_dict()
        for fn in self.unshard:
            state = fn(state)
        return state


def check_supported(config: Config) -> None:
    """Raise, before any collective, for layouts this build cannot run."""
    check_plan_syntax(config.tensor_parallel.plan)  # a PlanError is a ConfigError
    if config.pipeline.stages > 1:
        raise ConfigError("config key 'pipeline.stages' > 1: pipeline parallelism is not available in this "
                          "build yet; set it to 1")
    if config.zero_optimization.stage > 0:
        raise ConfigError(f"config key 'zero_optimization.stage' = {config.zero_optimization.stage}: ZeRO is "
                          f"not available in this build yet; use stage 0 (DDP)")
    if config.fp16.enabled or config.bf16.enabled:
        raise ConfigError("fp16/bf16 training is not available in this build yet; disable fp16.enabled and "
                          "bf16.enabled")
    if config.activation_checkpointing.enabled:
        raise ConfigError("config key 'activation_checkpointing.enabled': not available in this build yet")


def _check_model(model: nn.Module, config: Config) -> None:
    """Checks that need the model, before anything changes or communicates."""
    cp, tp = config.context_parallel.size, config.tensor_parallel
    check_context_parallel(model, cp)
    seq_len = getattr(getattr(model, "config", None), "seq_len", None)
    if cp > 1 and tp.size > 1 and tp.sequence_parallel and isinstance(seq_len, int) and seq_len % (cp * tp.size):
        raise ConfigError(f"context_parallel.size ({cp}) with tensor_parallel.sequence_parallel: each cp rank's "
                          f"{seq_len // cp} tokens are split again over tensor_parallel.size ({tp.size}); use a "
                          f"sequence length (model seq_len {seq_len}) divisible by {cp * tp.size}")


def parallelize(model: nn.Module, mesh: Mesh, config: Config, device: torch.device | None = None) -> ParallelModel:
    check_supported(config)
    _check_model(model, config)
    unshard = []
    notes = []
    tp = config.tensor_parallel
    if tp.size > 1:  # 1. split before moving: each rank moves only its shard to the device
        applied = tensor_parallelize(model, mesh, tp.plan, sequence_parallel=tp.sequence_parallel, seed=config.seed)
        unshard.append(applied.unshard)
    if config.context_parallel.size > 1:  # 3. ring attention; parameters stay replicated over cp
        ring = context_parallelize(model, mesh)
        notes.append(f"context parallel over {ring.axis.size} ranks: ring attention in {len(ring.cores)} layers")
    if device is not None:
        model.to(device)
    dp = config.data_parallel
    grad_sync = DistributedDataParallel(
        model, mesh, bucket_cap_mb=dp.bucket_cap_mb, allow_unused_parameters=dp.allow_unused_parameters,
        prescale=config.prescale_gradients, predivide_factor=config.gradient_predivide_factor,
        broadcast_buffers=dp.broadcast_buffers)
    return ParallelModel(model, grad_sync, unshard, notes)
