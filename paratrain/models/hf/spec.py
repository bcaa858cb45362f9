"""The model spec of Hugging Face causal LMs: every strategy from the model's own config and structure.

    tp_plan          the config's `base_model_tp_plan`, translated (`hf/plan.py`), or name rules
    blocks           the decoder layers (the classes in `_no_split_modules`): ZeRO-3 units, checkpointed blocks
    attention_cores  the `core` each attention module got (`hf/model.py`): ring attention replaces it
    expert_layers    each MoE block's experts module, its stacked gate_up_proj and down_proj (`hf/moe.py`)
    pipeline_module  embeddings -> decoder layers -> final norm + head; each stage passes (hidden, positions)
                     and every layer recomputes its rotary embeddings from the positions
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch
from torch import nn

from paratrain.adapters import convert_peft_model, is_peft_model
from paratrain.config import ConfigError
from paratrain.data.micro_batch import MicroBatch
from paratrain.model_spec import ModelSpec, ModelSpecError, Pretrained, register_model_spec
from paratrain.models.decoder_pipeline import decoder_pipeline
from paratrain.models.hf.model import HFCausalLM, _positions, as_causal_lm, attention_modules, is_transformers_model
from paratrain.models.hf.moe import check_moe_config, hf_expert_layers
from paratrain.models.hf.plan import hf_tp_plan, localize_attention, supports_sequence_parallel
from paratrain.models.hf.pretrained import load_pretrained, materialize_buffers
from paratrain.moe.exchange import ExpertLayer
from paratrain.parallel.pp.module import PipelineModule


class HFEmbedStage(nn.Module):
    """The first pipeline layer: token ids -> (hidden, positions (b, s)). Its children keep the base model's
    attribute names (embed_tokens, or GPT-2's wte, wpe and drop)."""

    def __init__(self, model: HFCausalLM):
        super().__init__()
        object.__setattr__(self, "view", model)
        for name in (model.layout.embed, model.layout.positions, model.layout.dropout):
            if name is not None:
                self.add_module(name, getattr(model.base, name))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
        position_ids = _positions(input_ids, position_ids)
        return self.view.embed(input_ids, position_ids), position_ids  # (b, s, d), (b, s)


class _Holder(nn.Module):
    def __init__(self, name: str, module: nn.Module):
        super().__init__()
        self.add_module(name, module)


class HFFinalStage(nn.Module):
    """The last pipeline layer: final norm and head, under their names (model.norm, lm_head)."""

    def __init__(self, model: HFCausalLM):
        super().__init__()
        object.__setattr__(self, "view", model)
        self.add_module(model.layout.base, _Holder(model.layout.norm, getattr(model.base, model.layout.norm)))
        self.add_module(model.layout.head, model.head)

    def forward(self, x) -> torch.Tensor:
        h, _ = x
        return self.view.final(h)


def _stage_hooks(model: HFCausalLM, layer: nn.Module) -> None:
    """Let a decoder layer take and give the pipeline's (hidden, positions) pair; a call with a plain tensor
    (the whole model's forward) passes through unchanged."""
    if getattr(layer, "_paratrain_staged", False):
        return

    def before(module, args, kwargs):
        if not (args and isinstance(args[0], tuple)):
            return None
        h, positions = args[0]
        module.__dict__.setdefault("_paratrain_positions", []).append(positions)
        return (h,), {**kwargs, **model.layer_kwargs(h, positions)}

    def after(module, args, output):
        stack = module.__dict__.get("_paratrain_positions")
        if not stack:
            return None
        h = output[0] if isinstance(output, tuple) else output
        return h, stack.pop()

    layer.register_forward_pre_hook(before, with_kwargs=True)
    layer.register_forward_hook(after)
    layer._paratrain_staged = True


def hf_pipeline_module(model: HFCausalLM, micro_batch: int = 1) -> PipelineModule:
    layers = list(model.layers)
    for layer in layers:
        _stage_hooks(model, layer)
    return decoder_pipeline(HFEmbedStage(model), layers, HFFinalStage(model), model.loss_fn,
                            embed_name=model.layout.base, blocks_prefix=f"{model.layout.base}.{model.layout.layers}")


@register_model_spec
class HFSpec(ModelSpec):
    name = "hf"

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, HFCausalLM) or is_transformers_model(model) or \
            (is_peft_model(model) and is_transformers_model(model.base_model.model))

    def adapt(self, model: nn.Module) -> nn.Module:
        if isinstance(model, HFCausalLM):
            return model
        settings = None
        if is_peft_model(model):  # peft's layers become paratrain's, same parameters and names (adapters/from_peft)
            settings = convert_peft_model(model)
            model = model.base_model.model
        materialize_buffers(model)  # meta models: rotary inv_freq is in no weights file (hf/pretrained.py)
        view = as_causal_lm(model)
        view.adapter_settings = settings
        return view

    def adapter_settings(self, model: HFCausalLM):
        return getattr(model, "adapter_settings", None)

    def from_pretrained(self, path: str) -> Pretrained:
        return load_pretrained(path)

    def model_config(self, model: HFCausalLM) -> dict:
        config = json.loads(model.config.to_json_string(use_diff=False))
        config["architectures"] = [type(model.hf_model).__name__]  # what AutoModelForCausalLM builds
        return config

    def pretrained_files(self, model_config: dict | None, dtype: str) -> dict[str, str]:
        config = {**model_config, "dtype": dtype} if model_config else None
        if config is None:
            raise ModelSpecError("engine.save_pretrained: the model has no Hugging Face config")
        return {"config.json": json.dumps(config, indent=2, sort_keys=True) + "\n"}

    def to_hugging_face(self, state: dict[str, torch.Tensor], config: dict, model_config: dict | None = None,
                        **options) -> tuple[dict[str, torch.Tensor], dict]:
        """The names are already Hugging Face's (the view keeps them); the config.json is the one the checkpoint
        stored."""
        if model_config is None:
            raise ModelSpecError("the checkpoint holds no Hugging Face config (saved before checkpoints stored "
                                 "it); load it into an engine built from the model and call "
                                 "engine.save_pretrained(dir)")
        return dict(state), dict(model_config)

    def tp_plan(self, model: HFCausalLM) -> dict[str, str]:
        return hf_tp_plan(model)

    def after_split(self, model: HFCausalLM, sizes: Mapping[str, int]) -> None:
        localize_attention(model, sizes.get("tp", 1))

    def blocks(self, model: HFCausalLM) -> list[nn.Module]:
        return list(model.layers)

    def attention_cores(self, model: HFCausalLM) -> list[nn.Module]:
        return [attn.core for attn in attention_modules(model.layers)]

    def expert_layers(self, model: HFCausalLM) -> list[tuple[str, ExpertLayer]]:
        return hf_expert_layers(model)

    def pipeline_module(self, model: HFCausalLM, micro_batch: int) -> PipelineModule:
        return hf_pipeline_module(model, micro_batch)

    def sequence_length(self, model: nn.Module) -> int | None:
        return None

    def loss_is_token_mean(self, model: nn.Module) -> bool:
        return True

    def call(self, model: HFCausalLM, batch: MicroBatch):
        """transformers' `labels` form answers with its output type (`.loss`, `.logits`)."""
        return model(batch.input_ids, targets=batch.targets, position_ids=batch.position_ids,
                     documents=batch.documents, hf_output=batch.labels_form)

    def init_module(self, model: HFCausalLM, name: str, module: nn.Module) -> None:
        model.hf_model._init_weights(module)

    def check(self, model: HFCausalLM, sizes: Mapping[str, int]) -> None:
        cfg, tp, kind = model.config, sizes.get("tp", 1), type(model.hf_model).__name__
        check_moe_config(model, kind)
        heads = getattr(cfg, "num_attention_heads", None)
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        if tp > 1 and heads and (heads % tp or kv % tp):
            works = [t for t in range(1, kv + 1) if kv % t == 0 and heads % t == 0]
            raise ConfigError(f"tensor_parallel.size = {tp} does not divide {kind}'s num_attention_heads ({heads}) "
                              f"and num_key_value_heads ({kv}): each tp rank keeps whole heads; use a "
                              f"tensor_parallel.size in {works}")
        if sizes.get("pp", 1) > 1 and getattr(cfg, "tie_word_embeddings", False):
            raise ConfigError(f"pipeline.stages > 1 with {kind} whose tie_word_embeddings is true: the token table "
                              f"(first stage) and the head (last stage) would share one weight across stages, "
                              f"which paratrain's pipeline does not support; use pipeline.stages 1")
        if sizes.get("sp", 0) and not supports_sequence_parallel(model):
            raise ConfigError(f"tensor_parallel.sequence_parallel with {kind}: its position table is added after "
                              f"the token table with no module between them to start the sequence shard; set "
                              f"sequence_parallel to false")
