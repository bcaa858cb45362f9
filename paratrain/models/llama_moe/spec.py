"""The MoE Llama's model spec: the Llama's blocks and attention cores (same module names), its tensor-parallel
plan (the Llama's attention; dense blocks' MLPs split as the Llama's; MoE blocks whole on every tp rank, on
s/tp tokens under sequence parallelism, so their gradients are summed over tp), its initialization, and the
checks that keep every layout's routing equal to one process's."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from paratrain.config import ConfigError
from paratrain.data.micro_batch import add_to_loss
from paratrain.model_spec import register_model_spec
from paratrain.models.decoder_pipeline import decoder_pipeline
from paratrain.models.llama.spec import LLAMA_PLAN, LlamaEmbedStage, LlamaFinalStage, LlamaSpec
from paratrain.models.llama_moe.model import LlamaMoE, init_moe_module
from paratrain.parallel.pp.module import PipelineModule


class MoEEmbedStage(LlamaEmbedStage):
    """The first stage: (h, position_ids, the router losses so far: 0), so each MoE block adds its own."""

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None):
        h, position_ids = super().forward(idx, position_ids)
        return h, position_ids, h.new_zeros((), dtype=torch.float32)


class MoEFinalStage(LlamaFinalStage):
    def forward(self, x):
        h, positions, router = x
        return super().forward((h, positions)), router


class RouterLossAdded(nn.Module):
    """The pipeline's loss: the model's token loss of the logits plus the router losses the stages summed,
    which is the loss the unsplit model returns."""

    def __init__(self, token_loss: nn.Module):
        super().__init__()
        self.token_loss = token_loss

    def forward(self, output, targets: torch.Tensor) -> torch.Tensor:
        logits, router = output
        return add_to_loss(self.token_loss(logits, targets), router)


def llama_moe_pipeline_module(model: LlamaMoE, micro_batch: int = 1) -> PipelineModule:
    cfg, inner = model.config, model.model
    return decoder_pipeline(MoEEmbedStage(inner.embed_tokens), inner.layers, MoEFinalStage(inner.norm, model.lm_head),
                            RouterLossAdded(model.loss_fn), embed_name="model", blocks_prefix="model.layers",
                            example_shape=(cfg.vocab_size, micro_batch, cfg.seq_len))


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

    def pipeline_module(self, model: LlamaMoE, micro_batch: int) -> PipelineModule:
        return llama_moe_pipeline_module(model, micro_batch)

    def init_module(self, model: LlamaMoE, name: str, module: nn.Module) -> None:
        init_moe_module(name, module)

    def check(self, model: LlamaMoE, sizes: Mapping[str, int]) -> None:
        super().check(model, sizes)
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
