"""The MoE Llama's model spec: the Llama's blocks and attention cores (same module names), its
initialization, and refusals, by config key, of the layouts whose MoE side is not built yet."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from paratrain.config import ConfigError
from paratrain.model_spec import ModelSpecError, register_model_spec
from paratrain.models.llama_moe import LlamaMoE, init_moe_module
from paratrain.models.llama_spec import LlamaSpec


@register_model_spec
class LlamaMoESpec(LlamaSpec):
    """blocks, attention_cores, sequence_length: inherited from the Llama's spec (the same paths)."""

    name = "llama-moe"

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, LlamaMoE)

    def tp_plan(self, model: nn.Module) -> None:
        return None  # no plan: check() refuses tensor parallelism before a plan would be asked for

    def pipeline_module(self, model: LlamaMoE, micro_batch: int):
        raise ModelSpecError("pipeline.stages > 1 with a Llama MoE model: the router losses each block adds to "
                             "the loss do not travel between pipeline stages yet; use pipeline.stages 1")

    def init_module(self, model: LlamaMoE, name: str, module: nn.Module) -> None:
        init_moe_module(name, module)

    def check(self, model: LlamaMoE, sizes: Mapping[str, int]) -> None:
        # Each refusal is a part not built yet, not a limit of the model: tensor parallelism has no plan for
        # stacked experts, a pipeline would lose the router losses, and context parallelism would route and
        # balance each rank's chunk of a sample on its own (other losses and capacities than one process).
        if sizes.get("tp", 1) > 1:
            raise ConfigError(f"tensor_parallel.size = {sizes['tp']} with a Llama MoE model: tensor parallelism "
                              f"of the experts is not built yet; use tensor_parallel.size 1 (data parallelism "
                              f"or ZeRO scale it)")
        if sizes.get("pp", 1) > 1:
            raise ConfigError(f"pipeline.stages = {sizes['pp']} with a Llama MoE model: the router losses do not "
                              f"travel between pipeline stages yet; use pipeline.stages 1")
        if sizes.get("cp", 1) > 1:
            raise ConfigError(f"context_parallel.size = {sizes['cp']} with a Llama MoE model: each rank would "
                              f"route and balance only its chunk of every sample; use context_parallel.size 1")
