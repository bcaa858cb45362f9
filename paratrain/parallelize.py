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
from paratrain.data_parallel.flat import Placement
from paratrain.data_parallel.fsdp import FullyShardedDataParallel
from paratrain.data_parallel.fsdp_units import config_wrap_policy
from paratrain.data_parallel.zero import ZeroDataParallel
from paratrain.mesh import Mesh
from paratrain.origin import Origin
from paratrain.tensor_parallel import RNGTracker
from paratrain.tensor_parallel import parallelize as tensor_parallelize
from paratrain.tensor_parallel.plan import check_plan_syntax


@dataclass
class ParallelModel:
    """What parallelize produces: the local module and the strategy that synchronizes its gradients.

    `unshard` undoes the model-parallel steps for `full_state_dict`: the data-parallel strategy first
    gives this rank's module state with ZeRO shards gathered, then each function (added by the TP, PP, ...
    steps, in the order they are to be undone) turns it into the state of the original model.
    `origins` does the same for one tensor's coordinates, without communication (checkpoints): each step
    inserts its function at the front, so the last step applied is undone first. `random_streams` are the
    per-rank random generators the steps created (their states go into checkpoints).
    """

    module: nn.Module
    grad_sync: GradSync
    unshard: list[Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    origins: list[Callable[[Origin], Origin]] = field(default_factory=list)
    random_streams: dict[str, RNGTracker] = field(default_factory=dict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = self.grad_sync.full_state_dict()
        for fn in self.unshard:
            state = fn(state)
        return state

    def origin(self, local_name: str, tensor: torch.Tensor) -> Origin:
        """Which tensor of the original model a tensor of the local module is, and which box of it."""
        found = Origin.local(local_name, tensor)
        for fn in self.origins:
            found = fn(found)
        return found


def check_supported(config: Config) -> None:
    """Raise, before any collective, for layouts this build cannot run."""
    check_plan_syntax(config.tensor_parallel.plan)  # a PlanError is a ConfigError
    if config.pipeline.stages > 1:
        raise ConfigError("config key 'pipeline.stages' > 1: pipeline parallelism is not available in this "
                          "build yet; set it to 1")
    if config.context_parallel.size > 1:
        raise ConfigError("config key 'context_parallel.size' > 1: context parallelism is not available in "
                          "this build yet; set it to 1")
    zero = config.zero_optimization
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        raise ConfigError("config key 'zero_optimization.offload_optimizer.device' = \"cpu\" needs sharded "
                          "optimizer states; set zero_optimization.stage to 1, 2 or 3")
    if zero.offload_param.device != "none":
        if zero.stage != 3:
            raise ConfigError(f"config key 'zero_optimization.offload_param.device' = \"cpu\" needs sharded "
                              f"parameters; set zero_optimization.stage to 3 (it is {zero.stage})")
        if zero.offload_optimizer.device == "none":
            raise ConfigError("config key 'zero_optimization.offload_param.device' = \"cpu\": the parameter "
                              "shard is the fp32 master the optimizer updates, so it can only live on the host "
                              "with the optimizer; also set zero_optimization.offload_optimizer.device to \"cpu\"")
    if config.activation_checkpointing.enabled:
        raise ConfigError("config key 'activation_checkpointing.enabled': not available in this build yet")


def parallelize(model: nn.Module, mesh: Mesh, config: Config, device: torch.device | None = None) -> ParallelModel:
    check_supported(config)
    unshard, origins, streams = [], [], {}
    tp = config.tensor_parallel
    if tp.size > 1:  # 1. split before moving: each rank moves only its shard to the device
        applied = tensor_parallelize(model, mesh, tp.plan, sequence_parallel=tp.sequence_parallel, seed=config.seed)
        unshard.append(applied.unshard)
        origins.insert(0, applied.origin)
        streams["tp"] = applied.tracker
    if device is not None:
        model.to(device)
    grad_sync = _data_parallel(model, mesh, config, device or torch.device("cpu"))
    return ParallelModel(model, grad_sync, unshard, origins=origins, random_streams=streams)


def _data_parallel(model: nn.Module, mesh: Mesh, config: Config, device: torch.device) -> GradSync:
    """Step 5: DDP (stage 0, fp32), ZeRO-1/2 (or mixed-precision stage 0) over flat buckets, or FSDP."""
    dp, zero = config.data_parallel, config.zero_optimization
    if zero.stage == 0 and config.precision == "fp32":
        return DistributedDataParallel(
            model, mesh, bucket_cap_mb=dp.bucket_cap_mb, allow_unused_parameters=dp.allow_unused_parameters,
            prescale=config.prescale_gradients, predivide_factor=config.gradient_predivide_factor,
            broadcast_buffers=dp.broadcast_buffers)
    placement = Placement(device, offload_optimizer=zero.offload_optimizer.device == "cpu",
                          offload_param=zero.offload_param.device == "cpu",
                          pin_memory=zero.offload_optimizer.pin_memory or zero.offload_param.pin_memory)
    predivide = mesh.size(("dp", "cp")) if config.prescale_gradients else config.gradient_predivide_factor
    if zero.stage <= 2:
        return ZeroDataParallel(model, mesh, zero.stage, precision=config.precision,
                                bucket_numel=zero.reduce_bucket_size, placement=placement,
                                allow_unused_parameters=dp.allow_unused_parameters, predivide_factor=predivide)
    return FullyShardedDataParallel(
        model, mesh, precision=config.precision, placement=placement,
        wrap_policy=config_wrap_policy(model, zero.wrap_module_classes, zero.wrap_module_names),
        reshard_after_forward=zero.reshard_after_forward,
        persistence_threshold=zero.stage3_param_persistence_threshold, prefetch_depth=zero.prefetch_depth,
        allow_unused_parameters=dp.allow_unused_parameters, predivide_factor=predivide)
