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
from paratrain.data_parallel.base import GradSync
from paratrain.data_parallel.ddp import DistributedDataParallel
from paratrain.mesh import Mesh
from paratrain.pipeline.module import PipelineModule
from paratrain.pipeline.runtime import PipelineRunner
from paratrain.pipeline.schedules import ScheduleError, check_sizes
from paratrain.pipeline.split import make_unshard, split_pipeline


@dataclass
class ParallelModel:
    """What parallelize produces: the local module and the strategy that synchronizes its gradients.

    `unshard` undoes the model-parallel steps for `full_state_dict`: the data-parallel strategy first
    gives this rank's module state with ZeRO shards gathered, then each function (added by the TP, PP, ...
    steps, in the order they are to be undone) turns it into the state of the original model.
    `pipeline` (pipeline.stages > 1) runs whole steps of micro-batches; the engine delegates train_batch
    and eval_batch to it.
    """

    module: nn.Module
    grad_sync: GradSync
    unshard: list[Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pipeline: PipelineRunner | None = None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = self.grad_sync.full_state_dict()
        for fn in self.unshard:
            state = fn(state)
        return state


def check_supported(config: Config) -> None:
    """Raise, before any collective, for layouts this build cannot run."""
    if config.tensor_parallel.size > 1:
        raise ConfigError("config key 'tensor_parallel.size' > 1: tensor parallelism is not available in this "
                          "build yet; set it to 1")
    pp = config.pipeline
    if pp.stages > 1 and config.gradient_accumulation_steps is not None:
        try:
            check_sizes(pp.schedule, pp.stages, config.gradient_accumulation_steps, pp.virtual_stages)
        except ScheduleError as exc:
            raise ConfigError(f"config section 'pipeline': {exc}") from None
    if config.context_parallel.size > 1:
        raise ConfigError("config key 'context_parallel.size' > 1: context parallelism is not available in "
                          "this build yet; set it to 1")
    if config.zero_optimization.stage > 0:
        raise ConfigError(f"config key 'zero_optimization.stage' = {config.zero_optimization.stage}: ZeRO is "
                          f"not available in this build yet; use stage 0 (DDP)")
    if config.fp16.enabled or config.bf16.enabled:
        raise ConfigError("fp16/bf16 training is not available in this build yet; disable fp16.enabled and "
                          "bf16.enabled")
    if config.activation_checkpointing.enabled:
        raise ConfigError("config key 'activation_checkpointing.enabled': not available in this build yet")


def parallelize(model: nn.Module, mesh: Mesh, config: Config, device: torch.device | None = None) -> ParallelModel:
    check_supported(config)
    pipeline, unshard = None, []
    pp = config.pipeline
    if pp.stages > 1:  # 2. PP split: this rank keeps its stages' layers, the rest is freed
        split = split_pipeline(model, mesh, pp.stages, pp.virtual_stages, pp.partition,
                               micro_batch=config.train_micro_batch_size_per_gpu, device=device)
        model = split.module
        pipeline = PipelineRunner(split.module, mesh, pp.schedule, config.gradient_accumulation_steps,
                                  pp.virtual_stages, split.pipe.loss_fn, device or torch.device("cpu"))
        unshard.append(make_unshard(split, mesh))
    elif isinstance(model, PipelineModule):
        model.materialize()  # used whole, a PipelineModule is an ordinary model
    if device is not None:
        model.to(device)
    dp = config.data_parallel
    grad_sync = DistributedDataParallel(
        model, mesh, bucket_cap_mb=dp.bucket_cap_mb, allow_unused_parameters=dp.allow_unused_parameters,
        prescale=config.prescale_gradients, predivide_factor=config.gradient_predivide_factor)
    if pipeline is not None:
        pipeline.grad_sync = grad_sync
    return ParallelModel(model, grad_sync, unshard=unshard, pipeline=pipeline)
