"""Step 2 of parallelize: cut the model into stages, keep this rank's, free the rest.

Every rank holds the whole model when it arrives (tiny or on the meta device for big ones; LayerSpecs
are not built yet), so all ranks compute the same boundaries from the same numbers: parameter counts,
or — for `balanced` — layer times profiled on every rank and averaged over the world with one
all-reduce. Layers of other stages are moved to the meta device (their memory is freed; the user's
model object keeps its structure). The step's `origin` gives each stage tensor its name in the model the
step was given, so the steps applied before it (tensor parallelism) see the names they produced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import paratrain.comm as comm
from paratrain.layout.mesh import Mesh
from paratrain.layout.origin import Origin, Step
from paratrain.layout.placement import Partition, Placements
from paratrain.parallel.pp.module import LayerSpec, PipelineModule, StageChunk, StageModule
from paratrain.parallel.pp.partition import (
    METHODS,
    PartitionError,
    balanced_boundaries,
    check_manual,
    parameter_counts,
    profile_layer_costs,
)
from paratrain.parallel.pp.schedules import stages_of_rank
from paratrain.parallel.pp.v_partition import v_balanced_boundaries


@dataclass
class PipelineSplit(Step):
    """The pipeline step: this rank's stages, and the names their tensors have in the model the step was given
    (a PipelineModule's own `i.key`, or, for a model its spec turned into layers, the model's names)."""

    module: StageModule
    pipe: PipelineModule
    bounds: list[int]  # layer boundaries of all p·v stages
    method: str
    own_names: bool = True  # the step was given the PipelineModule itself (not a model its spec split)
    name = "pipeline split"

    def layers_of(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    def received_name(self, index: int, key: str) -> str:
        """The name of layer `index`'s tensor `key` in the module this step was given."""
        return f"{index}.{key}" if self.own_names else self.pipe.original_name(index, key)

    def __post_init__(self) -> None:
        self._names = _received_names(self)  # StageModule name -> received name
        self._local = {received: local for local, received in self._names.items()}

    def origin(self, found: Origin) -> Origin:
        """A stage holds whole layers: undoing the split is a renaming (StageModule name -> received name)."""
        return found.renamed(self._names[found.name])

    def forward_name(self, name: str) -> str:
        return self._local.get(name, name)

    def note(self) -> str:
        return f"pipeline stages {self.module.stages} of {len(self.bounds) - 1} ({self.method} partition)"


def choose_boundaries(pipe: PipelineModule, partition, parts: int, mesh: Mesh | None = None,
                      placement: str = "loop") -> tuple[list[int], str]:
    """Boundaries of `parts` stages by `partition` (a method name or the boundaries themselves). Under a "v"
    placement the weights balance each rank's two chunks together (`v_partition.py`), not chunk by chunk."""
    n = len(pipe)

    def cut(weights: list[float]) -> list[int]:
        return v_balanced_boundaries(weights, parts // 2) if placement == "v" else balanced_boundaries(weights, parts)

    if parts > n:
        raise PartitionError(f"pipeline.stages x pipeline.virtual_stages = {parts} stages, but the model has only "
                             f"{n} layers; use at most {n} stages or split the model into more layers")
    if not isinstance(partition, str):
        return check_manual(partition, n, parts), "manual"
    method = partition.lower()
    if method == "uniform":
        return cut([1.0] * n), method
    if method == "parameters":
        return cut([float(c) for c in parameter_counts(pipe.specs)]), method
    if method == "balanced":
        if pipe.example_input is None:
            raise PartitionError("pipeline.partition 'balanced' profiles every layer on an example micro-batch: pass "
                                 "PipelineModule(..., example_input=...) or use 'parameters'")
        if any(p.is_meta for p in pipe.parameters()):
            raise PartitionError("pipeline.partition 'balanced' times every layer on an example micro-batch, which "
                                 "a model on the meta device (deferred initialization) cannot run; use 'parameters'")
        costs = torch.tensor(profile_layer_costs([pipe.layer(i) for i in range(n)], pipe.example_input),
                             dtype=torch.float64)
        if mesh is not None:  # every rank must cut at the same place: average the measured times
            world = mesh.world
            comm.all_reduce(costs, world, tag="partition")
            costs /= world.size
        return cut(costs.tolist()), method
    raise PartitionError(f"unknown pipeline.partition {partition!r}; use one of {', '.join(METHODS)} or a list of "
                         f"stage boundaries")


def _free(module: nn.Module) -> None:
    """Move a layer another stage holds to the meta device. A parameter of a tensor subclass that cannot be rebuilt
    there (a bitsandbytes 4-bit weight, whose detach drops its type) becomes a plain one of its shape first."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and type(param) is not nn.Parameter:
                sub._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                                     requires_grad=param.requires_grad)
    module.to("meta")


def split_pipeline(pipe: PipelineModule, mesh: Mesh, stages: int, virtual: int, partition, placement: str = "loop",
                   device: torch.device | None = None, own_names: bool = True,
                   placements: Placements | None = None) -> PipelineSplit:
    """Keep the layers of this rank's stages (chunk c = stage c·p + pp rank; under a "v" placement stages r
    and 2p - 1 - r); free the others, and record in `placements` (the parallel model's) that the pp ranks hold
    different parameters. `own_names`: `pipe` is the model itself (False: a model's spec made `pipe` from it,
    and its layer names are the model's)."""
    placements = Placements() if placements is None else placements
    if pipe.num_stages is not None and pipe.num_stages != stages:
        raise PartitionError(f"PipelineModule(num_stages={pipe.num_stages}) disagrees with pipeline.stages = "
                             f"{stages}; set them equal (or leave num_stages out)")
    chosen = pipe.partition if pipe.partition is not None else partition
    bounds, method = choose_boundaries(pipe, chosen, stages * virtual, mesh, placement)
    rank = mesh.local_rank("pp")
    mine = stages_of_rank(placement, rank, stages, virtual)
    chunks = []
    for s in mine:
        layers = [pipe.layer(i) for i in range(bounds[s], bounds[s + 1])]
        chunks.append(StageChunk([layer.to(device) if device is not None else layer for layer in layers],
                                 first=bounds[s] == 0))
    local = {i for s in mine for i in range(bounds[s], bounds[s + 1])}
    for i, spec in enumerate(pipe.specs):
        if i not in local and isinstance(spec, nn.Module):
            _free(spec)  # what other stages hold
        elif i not in local:
            assert isinstance(spec, LayerSpec)
    stage_module = StageModule(chunks, mine)
    for param in stage_module.parameters():  # the pp ranks hold different layers: their gradients all count
        placements.record(param, "pp", Partition())
    return PipelineSplit(stage_module, pipe, bounds, method, own_names)


def _received_names(split: PipelineSplit) -> dict[str, str]:
    """{name in this rank's StageModule: name in the module the step was given}."""
    names: dict[str, str] = {}
    for c, stage in enumerate(split.module.stages):
        for k, i in enumerate(split.layers_of(stage)):
            for key in split.pipe.layer_state_keys(i):
                names[f"chunks.{c}.layers.{k}.{key}"] = split.received_name(i, key)
    return names
