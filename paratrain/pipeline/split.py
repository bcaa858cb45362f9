"""Step 2 of parallelize: cut the model into stages, keep this rank's, free the rest.

Every rank holds the whole model when it arrives (tiny or on the meta device for big ones; LayerSpecs
are not built yet), so all ranks compute the same boundaries from the same numbers: parameter counts,
or — for `balanced` — layer times profiled on every rank and averaged over the world with one
all-reduce. Layers of other stages are moved to the meta device (their memory is freed; the user's
model object keeps its structure). `unshard` gathers every stage's state over the pp axis under the
original parameter names, for `full_state_dict`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain import comm
from paratrain.mesh import AXES, Mesh
from paratrain.pipeline.module import LayerSpec, PipelineModule, StageChunk, StageModule, as_pipeline_module
from paratrain.pipeline.partition import (
    METHODS,
    PartitionError,
    balanced_boundaries,
    check_manual,
    parameter_counts,
    profile_layer_costs,
)


@dataclass
class PipelineSplit:
    module: StageModule
    pipe: PipelineModule
    bounds: list[int]  # layer boundaries of all p·v stages
    method: str

    def layers_of(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])


def choose_boundaries(pipe: PipelineModule, partition, parts: int, mesh: Mesh | None = None) -> tuple[list[int], str]:
    """Boundaries of `parts` stages by `partition` (a method name or the boundaries themselves)."""
    n = len(pipe)
    if parts > n:
        raise PartitionError(f"pipeline.stages x pipeline.virtual_stages = {parts} stages, but the model has only "
                             f"{n} layers; use at most {n} stages or split the model into more layers")
    if not isinstance(partition, str):
        return check_manual(partition, n, parts), "manual"
    method = partition.lower()
    if method == "uniform":
        return balanced_boundaries([1.0] * n, parts), method
    if method == "parameters":
        return balanced_boundaries([float(c) for c in parameter_counts(pipe.specs)], parts), method
    if method == "balanced":
        if pipe.example_input is None:
            raise PartitionError("pipeline.partition 'balanced' profiles every layer on an example micro-batch: pass "
                                 "PipelineModule(..., example_input=...) or use 'parameters'")
        costs = torch.tensor(profile_layer_costs([pipe.layer(i) for i in range(n)], pipe.example_input),
                             dtype=torch.float64)
        if mesh is not None:  # every rank must cut at the same place: average the measured times
            world = mesh.axis(AXES)
            comm.all_reduce(costs, world, tag="partition")
            costs /= world.size
        return balanced_boundaries(costs.tolist(), parts), method
    raise PartitionError(f"unknown pipeline.partition {partition!r}; use one of {', '.join(METHODS)} or a list of "
                         f"stage boundaries")


def split_pipeline(model: nn.Module, mesh: Mesh, stages: int, virtual: int, partition,
                   micro_batch: int = 1, device: torch.device | None = None) -> PipelineSplit:
    """Keep the layers of this rank's stages (chunk c = stage c·p + pp rank); free the others."""
    pipe = as_pipeline_module(model, micro_batch)
    if pipe.num_stages is not None and pipe.num_stages != stages:
        raise PartitionError(f"PipelineModule(num_stages={pipe.num_stages}) disagrees with pipeline.stages = "
                             f"{stages}; set them equal (or leave num_stages out)")
    chosen = pipe.partition if pipe.partition is not None else partition
    bounds, method = choose_boundaries(pipe, chosen, stages * virtual, mesh)
    rank = mesh.local_rank("pp")
    mine = [c * stages + rank for c in range(virtual)]
    chunks = []
    for s in mine:
        layers = [pipe.layer(i) for i in range(bounds[s], bounds[s + 1])]
        chunks.append(StageChunk([layer.to(device) if device is not None else layer for layer in layers]))
    local = {i for s in mine for i in range(bounds[s], bounds[s + 1])}
    for i, spec in enumerate(pipe.specs):
        if i not in local and isinstance(spec, nn.Module):
            spec.to("meta")  # free what other stages hold
        elif i not in local:
            assert isinstance(spec, LayerSpec)
    return PipelineSplit(StageModule(chunks, mine), pipe, bounds, method)


def _original_names(split: PipelineSplit) -> dict[str, str]:
    """{name in this rank's StageModule: name in the original model}."""
    names: dict[str, str] = {}
    for c, stage in enumerate(split.module.stages):
        for k, i in enumerate(split.layers_of(stage)):
            for key in split.pipe.layer_state_keys(i):
                names[f"chunks.{c}.layers.{k}.{key}"] = split.pipe.original_name(i, key)
    return names


def make_origin(split: PipelineSplit):
    """For checkpoints: a tensor of this rank's StageModule is the original model's tensor of another name
    (a stage holds whole layers, so nothing else changes)."""
    names = _original_names(split)
    return lambda origin: origin.renamed(names[origin.name])


def make_unshard(split: PipelineSplit, mesh: Mesh):
    """A function: this rank's StageModule state -> the whole model's state under the original names."""
    names = _original_names(split)
    order = [split.pipe.original_name(i, key) for i in range(len(split.pipe)) for key in split.pipe.layer_state_keys(i)]
    axis = mesh.axis("pp")

    def unshard(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        device = next(iter(state.values())).device if state else torch.device("cpu")
        mine = {names[k]: v.cpu() for k, v in state.items()}  # pickled tensors must not name another GPU
        merged: dict[str, torch.Tensor] = {}
        for part in comm.all_gather_object(mine, axis, tag="unshard"):
            merged.update(part)
        return {k: merged[k].to(device) for k in order if k in merged}

    return unshard
