"""Expert parallelism: each mixture-of-experts layer keeps E/ep of its experts, over the ep sub-axis of dp x cp.

    split = expert_parallelize(module, mesh)   # every MoELayer: experts [r·E/ep, (r+1)·E/ep) on ep rank r

The ep axis is folded inside dp x cp (`ParallelDims.expert_subgroups`): the ranks of an ep group see
different tokens and hold different experts, so a layer sends each token's rows to the rank of its expert and
back (`paratrain.moe.exchange`). The stacked expert tensors (E, out, in) are cut along dim 0 and recorded as
`Shard(0, E)` over "ep"; everything else of the model (attention, norms, routers, shared experts) is
untouched. The data-parallel strategy reads that record: expert gradients are summed over the
expert-data-parallel group (edp, the ranks holding the same experts) instead of all of dp x cp, and ZeRO shards
them over edp. The divisor stays dp x cp for both: each expert's gradient already holds the contributions of
every ep rank's tokens (the combine's backward brought them), so sum over edp / (dp·cp) is the mean over all
ranks, as for a dense parameter (dividing by edp only is DeepSpeed's "ep× too large" bug class).
"""

from __future__ import annotations

from torch import nn

from paratrain.config import ConfigError
from paratrain.mesh import Mesh
from paratrain.moe import MoELayer
from paratrain.moe.exchange import ExpertGroup
from paratrain.origin import Origin, Step
from paratrain.placement import Shard, place


def moe_layers(module: nn.Module) -> list[tuple[str, MoELayer]]:
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoELayer)]


def check_expert_parallel(model: nn.Module, ep: int) -> None:
    """Refuse, before anything changes, a model whose MoE layers the ep size cannot split."""
    layers = moe_layers(model)
    if not layers:
        raise ConfigError(f"expert_parallel.size = {ep}: the model has no paratrain.moe.MoELayer to split; set "
                          f"expert_parallel.size to 1, or build the model's experts with MoELayer")
    for name, layer in layers:
        if layer.num_experts % ep:
            works = [d for d in range(1, layer.num_experts + 1) if layer.num_experts % d == 0]
            raise ConfigError(f"expert_parallel.size = {ep} does not divide the {layer.num_experts} experts of "
                              f"'{name}'; use one of {works} (that also divides dp x cp)")


class ExpertSplit(Step):
    """The expert-parallel step: which layers it split, and the ep rank's slice of each stacked expert tensor."""

    name = "expert parallel"

    def __init__(self, group_axis, layers: list[str], experts: int):
        self.axis, self.layers, self.experts = group_axis, layers, experts

    def origin(self, found: Origin) -> Origin:
        kind = found.placement.get("ep")
        if isinstance(kind, Shard):
            return found.split(kind.dim, kind.full, self.axis.rank)
        return found

    def explain(self, name: str) -> str | None:
        path = name.rpartition(".")[0]
        if any(path.startswith(layer + ".") for layer in self.layers):
            return f"expert parallelism keeps experts of layer '{path.rpartition('.')[0]}' on this ep rank only"
        return None

    def note(self) -> str:
        return (f"expert parallel over {self.axis.size} ranks: {len(self.layers)} MoE layers, "
                f"{self.experts // self.axis.size} of {self.experts} experts each per rank")


def expert_parallelize(module: nn.Module, mesh: Mesh) -> ExpertSplit:
    """Keep this ep rank's experts of every MoE layer of `module` (in place; meta tensors stay meta)."""
    ep, _ = mesh.expert_axes()
    layers = moe_layers(module)
    for _, layer in layers:
        group = ExpertGroup(ep, layer.num_experts)
        lo, hi = group.first, group.first + group.local
        for pname, p in list(layer.experts.named_parameters(recurse=False)):
            local = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)
            for attribute, value in vars(p).items():  # records earlier steps left (tp placements)
                setattr(local, attribute, value)
            place(local, "ep", Shard(0, layer.num_experts))
            setattr(layer.experts, pname, local)
        layer.experts.num_experts = group.local
        layer.expert_parallel = group
    total = layers[0][1].num_experts if layers else 0
    return ExpertSplit(ep, [name for name, _ in layers], total)
