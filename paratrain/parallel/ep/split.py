"""Expert parallelism: each mixture-of-experts layer keeps E/ep of its experts, over the ep sub-axis of dp x cp.

    # experts [r·E/ep, (r+1)·E/ep) on ep rank r
    split = expert_parallelize(model, spec.expert_layers(model), mesh, placements)

The ep axis is folded inside dp x cp (`ParallelDims.expert_subgroups`): the ranks of an ep group see
different tokens and hold different experts, so a layer sends each token's rows to the rank of its expert and
back (`paratrain.moe.exchange`). The stacked expert tensors (E, out, in) are cut along dim 0 and recorded as
`Shard(0, E)` over "ep" in the parallel model's `Placements`; everything else of the model (attention, norms,
routers, shared experts) is untouched. The data-parallel strategy reads that record: expert gradients are
summed over the expert-data-parallel group (edp, the ranks holding the same experts) instead of all of dp x cp,
and ZeRO shards them over edp. The divisor stays dp x cp for both: each expert's gradient already holds the
contributions of every ep rank's tokens (the combine's backward brought them), so sum over edp / (dp·cp) is
the mean over all ranks, as for a dense parameter (dividing by edp only is DeepSpeed's "ep× too large" bug
class).
"""

from __future__ import annotations

from torch import nn

from paratrain.config.errors import ConfigError
from paratrain.layout.mesh import Mesh
from paratrain.layout.origin import Origin, Step
from paratrain.layout.placement import Placements, Shard
from paratrain.moe.exchange import ExpertGroup, ExpertLayer


def check_expert_parallel(layers: list[tuple[str, ExpertLayer]], ep: int) -> None:
    """Refuse, before anything changes, a model whose MoE layers (`ModelSpec.expert_layers`) ep cannot split."""
    if not layers:
        raise ConfigError(f"expert_parallel.size = {ep}: the model has no mixture-of-experts layer to split "
                          f"(paratrain.moe.MoELayer, deepspeed.moe.layer.MoE, or a Hugging Face MoE block); set "
                          f"expert_parallel.size to 1, or build the model's experts with one of those")
    for name, layer in layers:
        if layer.num_experts % ep:
            works = [d for d in range(1, layer.num_experts + 1) if layer.num_experts % d == 0]
            raise ConfigError(f"expert_parallel.size = {ep} does not divide the {layer.num_experts} experts of "
                              f"'{name}'; use one of {works} (that also divides dp x cp)")


class ExpertSplit(Step):
    """The expert-parallel step: which layers it split, and the ep rank's slice of each stacked expert tensor."""

    name = "expert parallel"

    def __init__(self, group_axis, layers: dict[str, str], experts: int):
        self.axis, self.layers, self.experts = group_axis, layers, experts  # layers: split tensor -> its layer

    def origin(self, found: Origin) -> Origin:
        kind = found.placement.get("ep")
        if isinstance(kind, Shard):
            return found.split(kind.dim, kind.full, self.axis.rank)
        return found

    def explain(self, name: str) -> str | None:
        layer = self.layers.get(name)
        return None if layer is None else f"expert parallelism keeps experts of layer '{layer}' on this ep rank only"

    def note(self) -> str:
        return (f"expert parallel over {self.axis.size} ranks: {len(set(self.layers.values()))} MoE layers, "
                f"{self.experts // self.axis.size} of {self.experts} experts each per rank")


def expert_parallelize(model: nn.Module, layers: list[tuple[str, ExpertLayer]], mesh: Mesh,
                       placements: Placements) -> ExpertSplit:
    """Keep this ep rank's experts of every MoE layer of `model` (`ModelSpec.expert_layers`; in place, meta
    tensors stay meta) and tell each layer which it keeps."""
    ep, _ = mesh.expert_axes()
    module_names = {id(m): name for name, m in model.named_modules()}
    split: dict[str, str] = {}
    for layer_name, layer in layers:
        group = ExpertGroup(ep, layer.num_experts)
        lo, hi = group.first, group.first + group.local
        for owner, pname in layer.stacked:
            p = getattr(owner, pname)
            local = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)
            for attribute, value in vars(p).items():  # marks others set on it (DeepSpeed's, the init state)
                setattr(local, attribute, value)
            placements.carry(p, local)  # what earlier steps recorded (tp)
            placements.record(local, "ep", Shard(0, layer.num_experts))
            setattr(owner, pname, local)
            split[f"{module_names[id(owner)]}.{pname}".lstrip(".")] = layer_name
        layer.assign(group)
    total = layers[0][1].num_experts if layers else 0
    return ExpertSplit(ep, split, total)
