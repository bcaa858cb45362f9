"""The MoE Llama's model spec: the Llama's blocks and attention cores (same module names), its tensor-parallel
plan (the Llama's attention; dense blocks' MLPs split as the Llama's; MoE blocks whole on every tp rank, on
s/tp tokens under sequence parallelism, so their gradients are summed over tp), its initialization, and the
checks that keep every layout's routing equal to one process's."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from paratrain.config import ConfigError
from paratrain.model_spec import ModelSpecError, register_model_spec
from paratrain.models.llama_moe import LlamaMoE, init_moe_module
from paratrain.models.llama_spec import LLAMA_PLAN, LlamaSpec


def llama_moe_plan(model: LlamaMoE) -> dict[str, str]:
    plan = {k: v for k, v in LLAMA_PLAN.items() if not k.startswith("model.layers.*.mlp")}
    for i in range(model.config.n_layer):
        if i < model.config.n_dense_layers:
            plan.update({k.replace("*", str(i)): v for k, v in LLAMA_PLAN.items()
                         if k.startswith("model.layers.*.mlp")})
        else:  # routed on this rank's tokens; under sequence parallelism, s/tp of them
            plan[f"model.layers.{i}.mlp"] = "sequence"
    return plan


@register_model_spec
class LlamaMoESpec(LlamaSpec):
    """blocks, attention_cores, sequence_length: inherited from the Llama's spec (the same paths)."""

    name = "llama-moe"

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, LlamaMoE)

    def tp_plan(self, model: nn.Module) -> dict[str, str]:
        return llama_moe_plan(model)

    def pipeline_module(self, model: LlamaMoE, micro_batch: int):
        raise ModelSpecError("pipeline.stages > 1 with a Llama MoE model: the router losses each block adds to "
                             "the loss do not travel between pipeline stages yet; use pipeline.stages 1")

    def init_module(self, model: LlamaMoE, name: str, module: nn.Module) -> None:
        init_moe_module(name, module)

    def check(self, model: LlamaMoE, sizes: Mapping[str, int]) -> None:
        super().check(model, sizes)
        if sizes.get("pp", 1) > 1:
            raise ConfigError(f"pipeline.stages = {sizes['pp']} with a Llama MoE model: the router losses do not "
                              f"travel between pipeline stages yet; use pipeline.stages 1")
        check_routing_groups(model.config, sizes)


def check_routing_groups(cfg, sizes: Mapping[str, int]) -> None:
    """Each rank must hold whole routing groups, or it would cap and balance part of a group on its own (other
    drops and losses than one process): the group must divide each rank's chunks of a sequence."""
    cp, tp, sp = sizes.get("cp", 1), sizes.get("tp", 1), sizes.get("sp", 0)
    pieces = (2 * cp if cp > 1 else 1) * (tp if sp else 1)
    chunk = cfg.seq_len // pieces
    if cfg.seq_len % pieces == 0 and chunk % cfg.group_size == 0:
        return
    layout = " x ".join(part for part in (f"context_parallel.size {cp} (2 chunks per rank)" if cp > 1 else "",
                                          f"sequence parallelism over {tp}" if sp else "") if part)
    works = [g for g in range(1, chunk + 1) if chunk % g == 0] if chunk else []
    raise ConfigError(f"router_group_size {cfg.group_size} of the Llama MoE does not divide the {chunk} tokens of "
                      f"each rank's chunk of a sequence under {layout}: each rank must route whole groups; set "
                      f"router_group_size to one of {works} (or a sequence length that splits evenly)")
