"""The one place that applies parallel strategies to a model, in a fixed order, each from its own settings
(`paratrain.parallel.settings`: a typed config section and a few scalars, never the whole config).

Order (each step sees the result of the previous one; each is a function of the module, its own mesh axis
and a few scalars):
  0. layer names (a PipelineModule's `layer_names`: the names its checkpoints use)
  1. tensor parallel plan (swap/shard modules over the tp axis)
  1b. expert parallel (each MoE layer keeps its ep rank's experts)
  2. pipeline split (keep this rank's stages over the pp axis)
  3. context parallel (ring attention over the cp axis)
  4. activation checkpointing
  5. data parallel: DDP or a ZeRO stage over the dp x cp axis (experts: over the expert-data-parallel one)
  6. the pipeline runner (pipeline.stages > 1), built last with everything it drives
What a step needs to know about the model comes from its spec (`paratrain.model_spec`), never its class.
Each step is kept in `ParallelModel.steps` and undoes itself for a tensor's coordinates (`Step.origin`: all
checkpoints and `full_state_dict` need); how it laid out each parameter goes into the one `Placements` the
steps share (`ParallelModel.placements`), read by the data-parallel strategy, the norm and checkpoints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from paratrain.adapters.quantized import packed_matrix_shape
from paratrain.data.micro_batch import MicroBatch
from paratrain.layout.mesh import Axis, Mesh
from paratrain.layout.origin import Origin, Renamed, Step
from paratrain.layout.placement import Placements
from paratrain.model_spec import DEFAULT_SPEC, ModelSpec, spec_for
from paratrain.parallel.checks import check_model
from paratrain.parallel.cp import context_parallelize, context_parallelize_stages
from paratrain.parallel.cp.apply import AppliedContextParallel
from paratrain.parallel.dp.base import GradSync
from paratrain.parallel.dp.ddp import DistributedDataParallel
from paratrain.parallel.dp.flat import OffloadPolicy, allocate_local
from paratrain.parallel.dp.fsdp import FullyShardedDataParallel
from paratrain.parallel.dp.fsdp_units import config_wrap_policy
from paratrain.parallel.dp.zero import ZERO_STAGES
from paratrain.parallel.ep.split import expert_parallelize
from paratrain.parallel.pp.module import PipelineModule
from paratrain.parallel.pp.runtime import PipelineRunner
from paratrain.parallel.pp.schedules import placement_of
from paratrain.parallel.pp.split import PipelineSplit, split_pipeline
from paratrain.parallel.recompute import checkpoint_activations
from paratrain.parallel.settings import DataParallelSettings, PipelineSettings, Strategies
from paratrain.parallel.tp import RNGTracker
from paratrain.parallel.tp import parallelize as tensor_parallelize
from paratrain.precision import autocast_context


def _local_origin(name: str, tensor: torch.Tensor, placements: Placements) -> Origin:
    """A local tensor as the whole original one; a whole 4-bit weight's packed bytes as the matrix they encode,
    (rows, columns/2), the box a tensor-parallel slice of them is located in (adapters/quantized.py)."""
    matrix = packed_matrix_shape(tensor)
    if matrix is not None and tensor.numel() == matrix[0] * matrix[1] and tuple(tensor.shape) != matrix:
        return Origin(name, matrix, (0, 0), matrix, placement=placements.of(tensor))
    return Origin.local(name, tensor, placements.of(tensor))


@dataclass
class ParallelModel:
    """What parallelize produces: the local module, the strategy that synchronizes its gradients, and the
    steps that made it (in the order applied). `pipeline` (pipeline.stages > 1) runs whole steps of
    micro-batches (train_batch, eval_batch). `random_streams` are the per-rank random generators the steps
    created (checkpoints save them); `autocast` makes the forward's autocast context (torch_autocast)."""

    module: nn.Module
    grad_sync: GradSync
    steps: list[Step] = field(default_factory=list)
    pipeline: PipelineRunner | None = None
    random_streams: dict[str, RNGTracker] = field(default_factory=dict)
    autocast: Callable = contextlib.nullcontext
    spec: ModelSpec = DEFAULT_SPEC  # the model family's spec (checkpoints record its name)
    deferred: bool = False  # built on the meta device: allocated, not yet filled (the engine fills it)
    context: AppliedContextParallel | None = None  # cp > 1: which tokens of each micro-batch this rank keeps
    placements: Placements = field(default_factory=Placements)  # how the steps laid out each parameter

    def prepare_batch(self, batch: MicroBatch) -> MicroBatch:
        """A token micro-batch as this rank runs it: its share of the sequence under context parallelism."""
        return batch if self.context is None else self.context.split_micro_batch(batch)

    def check_unsplit(self, args: tuple, kwargs: dict) -> None:
        """Refuse, under context parallelism, a forward call that is not token data (nothing to split)."""
        if self.context is not None:
            self.context.refuse_unsplit(args, kwargs)

    @property
    def notes(self) -> list[str]:
        return [step.note() for step in self.steps]

    def origin(self, local_name: str, tensor: torch.Tensor) -> Origin:
        """Which tensor of the original model a tensor of the local module is, and which box of it: the steps
        undone last first, so each sees the coordinates it produced."""
        found = _local_origin(local_name, tensor, self.placements)
        for step in reversed(self.steps):
            found = step.origin(found)
        return found

    def model_name(self, local_name: str, tensor: torch.Tensor) -> str:
        """The name a tensor of the local module has in the model `parallelize` was given: `origin`'s name
        without the steps that only relabel (a PipelineModule's `layer_names`). initialize's param groups and
        Muon's choices are written in these names, before any step replaced a parameter."""
        found = _local_origin(local_name, tensor, self.placements)
        for step in reversed(self.steps):
            if not step.relabels:
                found = step.origin(found)
        return found.name

    def local_name(self, name: str) -> str:
        """The local module's name of the original tensor `name` (the steps' renamings, first first)."""
        for step in self.steps:
            name = step.forward_name(name)
        return name

    def explain(self, name: str) -> str:
        """What each step did with the original tensor `name` (for errors that must name the real cause)."""
        said = []
        for step in self.steps:
            reason = step.explain(name)
            if reason:
                said.append(f"{step.name}: {reason}")
            name = step.forward_name(name)
        return "; ".join(said) or f"no step of {[s.name for s in self.steps]} split or renamed it"


def _layer_names(pipe: PipelineModule) -> Renamed | None:
    """Step 0: a PipelineModule whose `layer_names` differ from its own (index) names is known by them."""
    names = {f"{i}.{key}": pipe.original_name(i, key) for i in range(len(pipe)) for key in pipe.layer_state_keys(i)}
    return Renamed(names) if any(k != v for k, v in names.items()) else None


def parallelize(model: nn.Module, mesh: Mesh, strategies: Strategies | None = None,
                device: torch.device | None = None) -> ParallelModel:
    """Apply the strategies to `model` (in place) on `mesh`, each with its own settings (the engine cuts them
    out of a config that `resolve_config` has checked with `check_supported`)."""
    strategies = strategies or Strategies()
    spec = spec_for(model)
    check_model(model, strategies, spec)
    # A model on the meta device is split like any other; each rank then allocates only what it keeps, and
    # the engine fills it in (paratrain.init.replay, checkpoint.load_weights).
    deferred = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    cores = spec.attention_cores(model)  # found before any step replaces one
    steps: list[Step] = []
    streams: dict[str, RNGTracker] = {}
    placements = Placements()  # every step records how it laid out the parameters it touched
    if isinstance(model, PipelineModule) and (renamed := _layer_names(model)) is not None:
        steps.append(renamed)
    tp, applied = strategies.tensor.section, None
    if tp.size > 1:  # 1. split before moving: each rank moves only its shard to the device
        applied = tensor_parallelize(model, mesh, tp.plan, sequence_parallel=tp.sequence_parallel,
                                     seed=strategies.tensor.seed, placements=placements)
        spec.after_split(model, {"tp": tp.size})
        steps.append(applied)
        streams["tp"] = applied.tracker
    if mesh.expert_axes() is not None:  # 1b. before the pipeline split, which keeps whatever the stage holds
        steps.append(expert_parallelize(model, spec.expert_layers(model), mesh, placements))
    module, split = model, None
    pp = strategies.pipeline.section
    if pp.stages > 1:  # 2. PP split: this rank keeps its stages' layers, the rest is freed
        pipe = spec.pipeline_module(model, strategies.pipeline.micro_batch_size)
        split = split_pipeline(pipe, mesh, pp.stages, pp.virtual_stages, pp.partition, placement_of(pp.schedule),
                               device=None if deferred else device, own_names=pipe is model, placements=placements)
        steps.append(split)
        module = split.module
    elif isinstance(model, PipelineModule):
        model.materialize()  # used whole, a PipelineModule is an ordinary model
    ring = None
    if strategies.context.size > 1:  # 3. ring attention; parameters stay replicated over cp
        ring = _context_parallel(module, split, mesh, cores, strategies.context.method)
        cores = [ring.replaced.get(id(core), core) for core in cores]
        steps.append(ring)
    ac = strategies.recompute
    if ac.enabled:  # 4. recompute blocks (full) or attention cores (selective) in backward
        steps.append(checkpoint_activations(module, ac.granularity, blocks=spec.blocks(model), cores=cores,
                                            rng_streams=list(streams.values())))
    if device is not None and not deferred:
        module.to(device)
    device = device or torch.device("cpu")
    if deferred:  # ZeRO-3 allocates its parameters' shards itself; the others hold this rank's whole tensors
        allocate_local(module, device, parameters=strategies.data.zero.stage < 3)
    experts = mesh.expert_axes()
    grad_sync = _data_parallel(module, mesh, strategies.data, device, spec.blocks(model),  # 5.
                               sync_initial_state=not deferred, expert_axis=experts[1] if experts else None,
                               placements=placements)
    if applied is not None:  # SP: hook the parameters the later steps made
        applied.sum_replicated_gradients()
    autocast = autocast_context(strategies.autocast, device)
    runner = None if split is None else _pipeline_runner(  # 6.
        split, mesh, strategies.pipeline, device, grad_sync, ring, autocast, token_mean=spec.loss_is_token_mean(model))
    return ParallelModel(module, grad_sync, steps, runner, streams, autocast, spec, deferred, ring, placements)


def _pipeline_runner(split: PipelineSplit, mesh: Mesh, settings: PipelineSettings, device: torch.device,
                     grad_sync: GradSync, ring: AppliedContextParallel | None, autocast: Callable,
                     token_mean: bool) -> PipelineRunner:
    """Step 6: the runner drives the stage, the strategy and the split of micro-batches."""
    pp = settings.section
    return PipelineRunner(split.module, mesh, pp.schedule, settings.micro_batches, pp.virtual_stages,
                          split.pipe.loss_fn, device, grad_sync,
                          prepare_batch=ring.split_micro_batch if ring is not None else None, autocast=autocast,
                          token_loss=settings.token_loss and token_mean,
                          takes_documents=split.pipe.takes_documents())


def _context_parallel(module: nn.Module, split: PipelineSplit | None, mesh: Mesh, cores: list[nn.Module],
                      method: str):
    if split is None:  # the engine splits each micro-batch (ParallelModel.prepare_batch)
        return context_parallelize(module, mesh, cores, method, split_inputs=False)
    first = split.pipe.layer(0) if 0 in split.module.stages else None  # the runner splits each micro-batch
    return context_parallelize_stages(module, mesh, cores, first, method)


def _data_parallel(model: nn.Module, mesh: Mesh, settings: DataParallelSettings, device: torch.device,
                   blocks: list[nn.Module], sync_initial_state: bool = True,
                   expert_axis: Axis | None = None, placements: Placements | None = None) -> GradSync:
    """Step 5: DDP (stage 0, any precision) over dp x cp (every rank of it saw different tokens), or ZeRO-1/2
    over flat buckets or FSDP sharded over dp_shard x cp and replicated over dp_replicate (HSDP; all of dp x cp
    without replicas); parameters split over ep (experts) sharded over `expert_axis` (edp) instead. ZeRO-3's
    units are the spec's blocks unless the settings name other modules."""
    dp, zero, precision = settings.section, settings.zero, settings.precision
    axis = mesh.axis("dp_cp") if zero.stage == 0 else mesh.axis("dp_shard_cp")
    hsdp = {} if zero.stage == 0 else {"replicate": mesh.axis("dp_replicate")}
    predivide = mesh.size("dp_cp") if settings.prescale_gradients else settings.predivide_factor
    if zero.stage == 0:
        return DistributedDataParallel(
            model, axis, precision=precision, bucket_cap_mb=dp.bucket_cap_mb,
            allow_unused_parameters=dp.allow_unused_parameters, predivide_factor=predivide,
            broadcast_buffers=dp.broadcast_buffers, free_grad_buckets=zero.free_grad_buckets,
            sync_initial_state=sync_initial_state, expert_axis=expert_axis, placements=placements)
    offload = OffloadPolicy(device, offload_optimizer=zero.offload_optimizer.device == "cpu",
                            offload_param=zero.offload_param.device == "cpu",
                            pin_memory=zero.offload_optimizer.pin_memory or zero.offload_param.pin_memory)
    if zero.stage <= 2:
        stage_option = {"free_grad_buckets": zero.free_grad_buckets} if zero.stage == 1 else \
            {"reduce_at_boundary": zero.reduce_at_boundary or settings.partial_backwards}
        return ZERO_STAGES[zero.stage](model, axis, precision=precision, bucket_numel=zero.reduce_bucket_size,
                                       offload=offload, allow_unused_parameters=dp.allow_unused_parameters,
                                       predivide_factor=predivide,
                                       overlap_param_gather=zero.overlap_param_gather is not False,  # unset: on
                                       sync_initial_state=sync_initial_state, expert_axis=expert_axis,
                                       placements=placements, **hsdp, **stage_option)
    units = {id(b) for b in blocks}
    policy = config_wrap_policy(model, zero.wrap_module_classes, zero.wrap_module_names) \
        if zero.wrap_module_classes or zero.wrap_module_names else (lambda name, module: id(module) in units)
    return FullyShardedDataParallel(
        model, axis, precision=precision, offload=offload, wrap_policy=policy,
        reshard_after_forward=zero.reshard_after_forward,
        persistence_threshold=zero.stage3_param_persistence_threshold, prefetch_depth=zero.prefetch_depth,
        allow_unused_parameters=dp.allow_unused_parameters, predivide_factor=predivide,
        reduce_at_boundary=zero.reduce_at_boundary, sync_initial_state=sync_initial_state, expert_axis=expert_axis,
        placements=placements, **hsdp)
