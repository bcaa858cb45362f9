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

from paratrain.activation_checkpointing import attention_cores, checkpoint_activations, transformer_blocks
from paratrain.config import Config, ConfigError
from paratrain.context_parallel import (
    RingAttentionCore,
    check_context_parallel,
    context_parallelize,
    context_parallelize_stages,
)
from paratrain.data_parallel.base import GradSync
from paratrain.data_parallel.ddp import DistributedDataParallel
from paratrain.data_parallel.flat import Placement
from paratrain.data_parallel.fsdp import FullyShardedDataParallel
from paratrain.data_parallel.fsdp_units import config_wrap_policy
from paratrain.data_parallel.zero import ZeroDataParallel
from paratrain.mesh import Mesh
from paratrain.models.gpt import CausalAttentionCore
from paratrain.origin import Origin
from paratrain.pipeline.module import PipelineModule
from paratrain.pipeline.runtime import PipelineRunner
from paratrain.pipeline.schedules import ScheduleError, check_sizes
from paratrain.pipeline.split import make_origin, make_unshard, split_pipeline
from paratrain.tensor_parallel import RNGTracker
from paratrain.tensor_parallel import parallelize as tensor_parallelize
from paratrain.tensor_parallel.plan import check_plan_syntax

# What selective activation checkpointing recomputes: the GPT's attention core, or the ring attention that
# replaces it under context parallelism.
ATTENTION_CORES = (CausalAttentionCore, RingAttentionCore)


@dataclass
class ParallelModel:
    """What parallelize produces: the local module and the strategy that synchronizes its gradients.

    `unshard` undoes the model-parallel steps for `full_state_dict`: the data-parallel strategy first
    gives this rank's module state with ZeRO shards gathered, then each function (added by the TP, PP, ...
    steps, in the order they are to be undone) turns it into the state of the original model.
    `pipeline` (pipeline.stages > 1) runs whole steps of micro-batches; the engine delegates train_batch
    and eval_batch to it.
    `origins` does the same for one tensor's coordinates, without communication (checkpoints): each step
    inserts its function at the front, so the last step applied is undone first. `random_streams` are the
    per-rank random generators the steps created (their states go into checkpoints).
    """

    module: nn.Module
    grad_sync: GradSync
    unshard: list[Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pipeline: PipelineRunner | None = None
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
    pp = config.pipeline
    if pp.stages > 1 and config.gradient_accumulation_steps is not None:
        try:
            check_sizes(pp.schedule, pp.stages, config.gradient_accumulation_steps, pp.virtual_stages)
        except ScheduleError as exc:
            raise ConfigError(f"config section 'pipeline': {exc}") from None
    if pp.stages > 1 and config.zero_optimization.stage == 3:
        raise ConfigError("zero_optimization.stage 3 with pipeline.stages > 1 is not supported: every micro-batch "
                          "would all-gather each unit's parameters again in its forward and its backward (2m "
                          "gathers of the stage per step), which costs more than the pipeline saves, and stage 3 "
                          "gathers its root unit in the model's forward, which a pipeline stage never calls; a "
                          "stage already holds only its share of the model (DeepSpeed refuses the pair too). Use "
                          "zero_optimization.stage 1 or 2, or more pipeline stages")
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


def _check_model(model: nn.Module, config: Config) -> None:
    """Checks that need the model, before anything changes or communicates."""
    cp, tp = config.context_parallel.size, config.tensor_parallel
    check_context_parallel(model, cp)
    ac = config.activation_checkpointing
    if ac.enabled and not isinstance(model, PipelineModule):  # a PipelineModule's layers are its blocks
        if ac.granularity == "full" and not transformer_blocks(model):
            raise ConfigError(f"activation_checkpointing.granularity \"full\" recomputes each transformer block, "
                              f"the children of an nn.ModuleList, and {type(model).__name__} has none: keep the "
                              f"blocks in an nn.ModuleList, or write the model as a paratrain.PipelineModule")
        if ac.granularity == "selective" and not attention_cores(model, ATTENTION_CORES):
            raise ConfigError(f"activation_checkpointing.granularity \"selective\" recomputes the attention cores "
                              f"(paratrain.models.gpt.CausalAttentionCore modules) and {type(model).__name__} has "
                              f"none: build the attention with one, or use granularity \"full\"")
    seq_len = getattr(getattr(model, "config", None), "seq_len", None)
    if cp > 1 and tp.size > 1 and tp.sequence_parallel and isinstance(seq_len, int) and seq_len % (cp * tp.size):
        raise ConfigError(f"context_parallel.size ({cp}) with tensor_parallel.sequence_parallel: each cp rank's "
                          f"{seq_len // cp} tokens are split again over tensor_parallel.size ({tp.size}); use a "
                          f"sequence length (model seq_len {seq_len}) divisible by {cp * tp.size}")


def parallelize(model: nn.Module, mesh: Mesh, config: Config, device: torch.device | None = None) -> ParallelModel:
    check_supported(config)
    _check_model(model, config)
    pipeline, unshard, notes, origins, streams = None, [], [], [], {}
    blocks = None if isinstance(model, PipelineModule) else transformer_blocks(model)  # found on the whole model
    tp = config.tensor_parallel
    if tp.size > 1:  # 1. split before moving: each rank moves only its shard to the device
        applied = tensor_parallelize(model, mesh, tp.plan, sequence_parallel=tp.sequence_parallel, seed=config.seed)
        unshard.append(applied.unshard)
        origins.insert(0, applied.origin)
        streams["tp"] = applied.tracker
    pp = config.pipeline
    split = None
    if pp.stages > 1:  # 2. PP split: this rank keeps its stages' layers, the rest is freed
        split = split_pipeline(model, mesh, pp.stages, pp.virtual_stages, pp.partition,
                               micro_batch=config.train_micro_batch_size_per_gpu, device=device)
        model = split.module
        pipeline = PipelineRunner(split.module, mesh, pp.schedule, config.gradient_accumulation_steps,
                                  pp.virtual_stages, split.pipe.loss_fn, device or torch.device("cpu"))
        # Undone before the TP step: gather the stages over pp, then the tp shards of the whole model.
        unshard.insert(0, make_unshard(split, mesh))
        origins.insert(0, make_origin(split))
    elif isinstance(model, PipelineModule):
        model.materialize()  # used whole, a PipelineModule is an ordinary model
    if config.context_parallel.size > 1:  # 3. ring attention; parameters stay replicated over cp
        if split is None:
            ring = context_parallelize(model, mesh)
        else:  # no stage calls the model's forward: the runner splits each micro-batch instead
            first = split.pipe.layer(0) if 0 in split.module.stages else None
            ring = context_parallelize_stages(model, mesh, first)
            pipeline.prepare_batch = ring.split_batch
        notes.append(f"context parallel over {ring.axis.size} ranks: ring attention in {len(ring.cores)} layers")
    ac = config.activation_checkpointing
    if ac.enabled:  # 4. recompute blocks (full) or attention cores (selective) in backward
        if blocks is None:  # a PipelineModule: each of its layers this rank holds
            blocks = [layer for chunk in split.module.chunks for layer in chunk.layers] if split is not None \
                else list(model.specs)
        recomputed = checkpoint_activations(model, ac.granularity, blocks=blocks,
                                            cores=attention_cores(model, ATTENTION_CORES),
                                            rng_streams=list(streams.values()))
        notes.append(f"activation checkpointing ({ac.granularity}): {len(recomputed.modules)} modules recomputed")
    if device is not None:
        model.to(device)
    grad_sync = _data_parallel(model, mesh, config, device or torch.device("cpu"))
    if pipeline is not None:
        pipeline.grad_sync = grad_sync
    return ParallelModel(model, grad_sync, unshard=unshard, notes=notes, pipeline=pipeline, origins=origins,
                         random_streams=streams)


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
