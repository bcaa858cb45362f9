"""The Llama family's model spec: what `parallelize()` needs to know to apply every strategy to
`paratrain.models.Llama`. Names are Hugging Face's, so the plan reads like transformers' own
`base_model_tp_plan`, with sequence parallelism added."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from paratrain.config import ConfigError
from paratrain.model_spec import ModelSpec, register_model_spec
from paratrain.models.decoder_pipeline import decoder_pipeline
from paratrain.models.llama.model import Llama, init_module
from paratrain.parallel.pp.module import PipelineModule

# Megatron's layout: q/k/v and gate/up column-wise (k and v split by their own heads, so tp must divide
# n_kv_head), o and down row-wise, the vocabulary split in the table and the head (the loss stays
# vocab-parallel); under sequence parallelism the norms run on s/tp tokens, from the table's reduce-scatter
# to the head's all-gather.
LLAMA_PLAN: dict[str, str] = {
    "model.embed_tokens": "vocab_scatter",
    "model.layers.*.input_layernorm": "sequence",
    "model.layers.*.self_attn": "region_input",
    "model.layers.*.self_attn.[qkv]_proj": "colwise",
    "model.layers.*.self_attn.core": "in_region",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.post_attention_layernorm": "sequence",
    "model.layers.*.mlp": "region_input",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.norm": "sequence",
    "lm_head": "colwise_vocab",
    "loss_fn": "vocab_loss",
}


class LlamaEmbedStage(nn.Module):
    """The first pipeline layer: token ids -> (h, position_ids), so every later layer rotates by the right
    positions (context parallelism hands this layer its chunks' positions). Names: model.embed_tokens.*."""

    def __init__(self, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None):
        if position_ids is None:
            position_ids = torch.arange(idx.shape[1], device=idx.device)
        if position_ids.dim() == 1:  # always (b, s): the hand-over's shape may not depend on whether a row is padded
            position_ids = position_ids.expand(idx.shape[0], -1).contiguous()
        return self.embed_tokens(idx), position_ids  # (b, s, d), (b, s)


class _NormHolder(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm


class LlamaFinalStage(nn.Module):
    """The last pipeline layer: final norm and head (names kept: model.norm.*, lm_head.*)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.model = _NormHolder(norm)
        self.lm_head = lm_head

    def forward(self, x) -> torch.Tensor:
        h, _ = x
        return self.lm_head(self.model.norm(h))  # (b, s, d) -> (b, s, V)


def llama_pipeline_module(model: Llama, micro_batch: int = 1) -> PipelineModule:
    """The Llama as embed -> layers[0..n-1] -> (norm + head), sharing the model's own modules; the layer names
    keep its (Hugging Face) parameter names."""
    cfg, inner = model.config, model.model
    final = LlamaFinalStage(inner.norm, model.lm_head)
    return decoder_pipeline(LlamaEmbedStage(inner.embed_tokens), inner.layers, final, model.loss_fn,
                            embed_name="model", blocks_prefix="model.layers",
                            example_shape=(cfg.vocab_size, micro_batch, cfg.seq_len))


@register_model_spec
class LlamaSpec(ModelSpec):
    name = "llama"

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, Llama)

    def tp_plan(self, model: nn.Module) -> dict[str, str]:
        return LLAMA_PLAN

    def blocks(self, model: Llama) -> list[nn.Module]:
        return list(model.model.layers)

    def attention_cores(self, model: Llama) -> list[nn.Module]:
        return [layer.self_attn.core for layer in model.model.layers]

    def pipeline_module(self, model: Llama, micro_batch: int) -> PipelineModule:
        return llama_pipeline_module(model, micro_batch)

    def loss_is_token_mean(self, model: nn.Module) -> bool:
        return True

    def sequence_length(self, model: Llama) -> int:
        return model.config.seq_len

    def init_module(self, model: Llama, name: str, module: nn.Module) -> None:
        init_module(name, module)

    def check(self, model: Llama, sizes: Mapping[str, int]) -> None:
        cfg, tp = model.config, sizes.get("tp", 1)
        if cfg.n_kv_head % tp or cfg.n_head % tp:
            works = [t for t in range(1, cfg.n_kv_head + 1) if cfg.n_kv_head % t == 0 and cfg.n_head % t == 0]
            raise ConfigError(f"tensor_parallel.size = {tp} does not divide the Llama's n_kv_head "
                              f"({cfg.n_kv_head}) and n_head ({cfg.n_head}): each tp rank keeps whole k/v heads; "
                              f"use a tensor_parallel.size in {works}")
        if cfg.tie_embeddings and sizes.get("pp", 1) > 1:
            raise ConfigError("pipeline.stages > 1 with a Llama whose tie_embeddings is true: the token table "
                              "(first stage) and the head (last stage) would share one weight across stages, "
                              "which paratrain's pipeline does not support; untie them or use pipeline.stages 1")
