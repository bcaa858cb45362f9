"""The GPT's model spec: what `parallelize()` needs to know to apply every strategy to `paratrain.models.GPT`."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.model_spec import ModelSpec, register_model_spec
from paratrain.models.decoder_pipeline import decoder_pipeline
from paratrain.models.gpt.model import GPT, init_module
from paratrain.parallel.pp.module import PipelineModule

# Megatron's layout, with sequence parallelism starting after the embedding (token + position) and ending at
# the head's all-gather.
GPT_PLAN: dict[str, str] = {
    "embed.tok": "vocab",
    "embed": "sequence_scatter",
    "blocks.*.ln1": "sequence",
    "blocks.*.attn": "region_input",
    "blocks.*.attn.[qkv]": "colwise",
    "blocks.*.attn.core": "in_region",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.attn.resid_dropout": "sequence",
    "blocks.*.ln2": "sequence",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
    "blocks.*.mlp.dropout": "sequence",
    "ln_f": "sequence",
    "head": "colwise_vocab",
    "loss_fn": "vocab_loss",
}


class FinalNormHead(nn.Module):
    """The GPT's last pipeline layer: final norm and output projection (names kept: ln_f.*, head.*)."""

    def __init__(self, ln_f: nn.Module, head: nn.Module):
        super().__init__()
        self.ln_f = ln_f
        self.head = head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(h))  # (b, s, d) -> (b, s, V)


def gpt_pipeline_module(model: GPT, micro_batch: int = 1) -> PipelineModule:
    """The GPT as embed -> blocks[0..n-1] -> (ln_f + head), sharing the GPT's own modules; the layer names
    keep the GPT's parameter names."""
    cfg = model.config
    return decoder_pipeline(model.embed, model.blocks, FinalNormHead(model.ln_f, model.head), model.loss_fn,
                            embed_name="embed", blocks_prefix="blocks",
                            example_shape=(cfg.vocab_size, micro_batch, cfg.seq_len))


@register_model_spec
class GPTSpec(ModelSpec):
    name = "gpt"

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, GPT)

    def tp_plan(self, model: nn.Module) -> dict[str, str]:
        return GPT_PLAN

    def blocks(self, model: GPT) -> list[nn.Module]:
        return list(model.blocks)

    def attention_cores(self, model: GPT) -> list[nn.Module]:
        return [block.attn.core for block in model.blocks]

    def pipeline_module(self, model: GPT, micro_batch: int) -> PipelineModule:
        return gpt_pipeline_module(model, micro_batch)

    def loss_is_token_mean(self, model: nn.Module) -> bool:
        return True

    def sequence_length(self, model: GPT) -> int:
        return model.config.seq_len

    def init_module(self, model: GPT, name: str, module: nn.Module) -> None:
        init_module(model.config, name, module)

    def to_hugging_face(self, state, config, n_head: int | None = None, **options):
        from paratrain.models.gpt.hf_names import gpt2_config, to_gpt2

        return to_gpt2(state), gpt2_config(state, config, n_head)
