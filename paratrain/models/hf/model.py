"""Hugging Face causal language models, trained by paratrain with their config alone.

    hf = transformers.AutoModelForCausalLM.from_config(cfg)       # or from_pretrained(...)
    engine, *_ = paratrain.initialize(model=hf, config=ds_config)  # any layout: no plan written
    loss = engine(input_ids, targets)           # paratrain's form: targets already shifted, (b, s) each
    out = engine(input_ids=ids, labels=ids)     # transformers' form: out.loss, labels shifted inside

`initialize` trains an `HFCausalLM` in place of the transformers model: a view that shares the model's own
modules under the same attribute names (so every parameter keeps its Hugging Face name, and `save_pretrained`
files load with no map), and runs the decoder layer by layer itself: embeddings, the decoder layers with the
rotary embeddings of the given `position_ids`, the final norm, the head, and the loss as a replaceable module.

[Note: why a layered forward instead of the model's own]
Every strategy needs a seam the model's `forward` does not give: the pipeline cuts between decoder layers,
context parallelism feeds each rank its chunks' positions, tensor parallelism replaces the loss with the
vocab-parallel cross-entropy, and ring attention replaces the attention kernel. transformers already routes
attention through a registry (`AttentionInterface`); the view registers `"paratrain"` there, which calls a
`CausalAttentionCore` attached to each attention module as `core` (no parameters, so no name changes). That core
is what context parallelism and selective checkpointing replace, exactly as in the built-in families. No mask
tensor is built here: padding and packed documents arrive as `Documents` (`paratrain.data.micro_batch`, the
normal form of `attention_mask`, `position_ids` resets and `cu_seq_lens`), which the layers pass to the
attention function as a keyword, with each layer's own `sliding_window`; the core cuts its masks from them.
Experts modules of MoE blocks go through transformers' experts registry the same way (`hf/moe.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.attention import CausalAttentionCore, Documents
from paratrain.data.micro_batch import as_micro_batch
from paratrain.model_spec import ModelSpecError
from paratrain.models.gpt.model import TokenCrossEntropy, check_token_ids
from paratrain.models.hf.moe import install_experts

ATTENTION_NAME = "paratrain"  # the key in transformers' attention registry
ATTENTION_CHILDREN = ("self_attn", "attn", "attention", "self_attention")


def is_transformers_model(model: nn.Module) -> bool:
    """A `transformers.PreTrainedModel`, found without importing transformers."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


@dataclass(frozen=True)
class DecoderLayout:
    """Where the parts of a decoder-only model live (attribute names; `base` under the causal-LM model)."""

    base: str              # "model" (Llama, Qwen2, Mistral, Phi-3) or "transformer" (GPT-2)
    embed: str             # base.<embed>: the token table
    layers: str            # base.<layers>: the ModuleList of decoder layers
    norm: str              # base.<norm>: the final norm
    head: str              # <head>: the output projection
    rotary: str | None     # base.<rotary>: rotary embeddings (no parameters)
    positions: str | None  # base.<positions>: a learned position table (GPT-2's wpe)
    dropout: str | None    # base.<dropout>: dropout after the embeddings (GPT-2's drop)


def _child_name(parent: nn.Module, child: nn.Module) -> str | None:
    return next((name for name, m in parent.named_children() if m is child), None)


def decoder_layout(hf: nn.Module) -> DecoderLayout:
    """Find the decoder's parts by what they are; anything with parameters that fits no part is refused by name."""
    kind = type(hf).__name__
    base_name = getattr(hf, "base_model_prefix", "")
    base = getattr(hf, base_name, None)
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if not isinstance(base, nn.Module) or head is None:
        raise ModelSpecError(f"{kind} is not a decoder-only causal language model (no '{base_name}' base model or "
                             f"no output embeddings); paratrain's Hugging Face support needs an "
                             f"AutoModelForCausalLM-style model, or write a PipelineModule / model spec for it")
    embed = base.get_input_embeddings()
    no_split = set(getattr(hf, "_no_split_modules", None) or [])
    lists = [(n, m) for n, m in base.named_children() if isinstance(m, nn.ModuleList)
             and (not no_split or any(type(x).__name__ in no_split for x in m))]
    if len(lists) != 1:
        raise ModelSpecError(f"{kind}: expected one list of decoder layers in '{base_name}', found "
                             f"{[n for n, _ in lists] or 'none'}; paratrain cannot tell where the layers are")
    layers_name = lists[0][0]
    parts = {"embed": _child_name(base, embed), "layers": layers_name, "rotary": None, "positions": None,
             "dropout": None, "norm": None}
    for name, child in base.named_children():
        if name in (parts["embed"], layers_name):
            continue
        if "rotary" in name or type(child).__name__.endswith("RotaryEmbedding"):
            parts["rotary"] = name
        elif isinstance(child, nn.Embedding):
            parts["positions"] = name
        elif isinstance(child, nn.Dropout):
            parts["dropout"] = name
        elif "norm" in type(child).__name__.lower() or name in ("norm", "ln_f", "final_layernorm"):
            parts["norm"] = name
        elif any(True for _ in child.parameters()):
            raise ModelSpecError(f"{kind}: '{base_name}.{name}' ({type(child).__name__}) is neither the token "
                                 f"table, the decoder layers, the final norm nor a position table, so paratrain "
                                 f"cannot place it in a layered forward; write a model spec for {kind} "
                                 f"(paratrain.model_spec) or a PipelineModule")
    if parts["norm"] is None or parts["embed"] is None:
        raise ModelSpecError(f"{kind}: no final norm or token table found under '{base_name}'")
    return DecoderLayout(base=base_name, head=_child_name(hf, head) or "lm_head", **parts)


def paratrain_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        documents: Documents | None = None, sliding_window: int | None = None, **kwargs):
    """transformers' attention-function contract, answered by the module's `core` (q, k, v: (b, heads, s, d)),
    with the micro-batch's documents and the layer's sliding window."""
    if attention_mask is not None:
        raise ModelSpecError("a Hugging Face model under paratrain got an attention mask tensor inside a layer: "
                             "call the model (or the engine) with attention_mask=, which paratrain turns into "
                             "padding and documents for its attention cores")
    if scaling is not None and abs(scaling * query.shape[-1] ** 0.5 - 1) > 1e-6:
        raise ModelSpecError(f"{type(module).__name__} scales attention scores by {scaling}, not "
                             f"1/sqrt(head_dim): paratrain's attention core does not support that scale")
    if documents is None and sliding_window is None:
        out = module.core(query, key, value)  # (b, heads, s, d)
    else:
        out = module.core(query, key, value, documents, sliding_window)
    return out.transpose(1, 2).contiguous(), None  # transformers' layout: (b, s, heads, d)


def _register_attention(hf: nn.Module) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paratrain_attention)
    hf.set_attn_implementation(ATTENTION_NAME)


def attention_modules(layers: nn.ModuleList) -> list[nn.Module]:
    out = []
    for i, layer in enumerate(layers):
        found = [getattr(layer, n) for n in ATTENTION_CHILDREN if isinstance(getattr(layer, n, None), nn.Module)]
        if len(found) != 1:
            raise ModelSpecError(f"decoder layer {i} ({type(layer).__name__}) has no single attention module "
                                 f"named one of {ATTENTION_CHILDREN}")
        out.append(found[0])
    return out


class HFCausalLM(nn.Module):
    """A transformers causal LM as paratrain trains it (see the module docstring). `hf_model` is the original,
    whose modules this view shares; `config` is its (Hugging Face) config."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        layout = decoder_layout(hf_model)
        self.layout = layout
        setattr(self, layout.base, getattr(hf_model, layout.base))
        setattr(self, layout.head, getattr(hf_model, layout.head))
        self.loss_fn = TokenCrossEntropy()
        self.config = hf_model.config
        object.__setattr__(self, "hf_model", hf_model)  # not a child: its parameters are already ours
        self.adapter_settings = None  # a peft model's adapters (set by its spec's adapt)
        _register_attention(hf_model)
        install_experts(hf_model)  # MoE blocks' experts: paratrain's dispatch and all-to-alls (hf/moe.py)
        for attn in attention_modules(self.layers):
            if not isinstance(getattr(attn, "core", None), nn.Module):
                attn.core = CausalAttentionCore(float(getattr(attn, "attention_dropout", 0.0) or 0.0))

    @property
    def base(self) -> nn.Module:
        return getattr(self, self.layout.base)

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.base, self.layout.layers)

    @property
    def head(self) -> nn.Module:
        return getattr(self, self.layout.head)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        base, layout = self.base, self.layout
        h = getattr(base, layout.embed)(input_ids)  # (b, s, d)
        if layout.positions is not None:
            h = h + getattr(base, layout.positions)(position_ids)
        if layout.dropout is not None:
            h = getattr(base, layout.dropout)(h)
        return h

    def layer_kwargs(self, h: torch.Tensor, position_ids: torch.Tensor, documents: Documents | None = None) -> dict:
        """What every decoder layer takes besides the hidden states: no mask, no cache, the documents (passed on
        to the attention function), and the rotary embeddings of `position_ids` (b, s) if the model has them
        (computed once per forward, as transformers does)."""
        extra = {"attention_mask": None, "use_cache": False}
        if documents is not None:
            extra["documents"] = documents
        if self.layout.rotary is not None:
            rotary = getattr(self.base, self.layout.rotary)
            extra.update(position_embeddings=rotary(h, position_ids), position_ids=position_ids)
        return extra

    def final(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(getattr(self.base, self.layout.norm)(h))  # (b, s, V)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, documents: Documents | None = None,
                hf_output: bool = False, **boundaries):
        """input_ids (b, s) -> the mean loss over `targets` (b, s), or transformers' output with `.loss` (labels
        shifted inside, as `...ForCausalLM` does) when `labels` is given (or `hf_output`), else the logits
        (b, s, V). transformers' padding `attention_mask` and packing (`position_ids` restarting at 0,
        `cu_seq_lens_q`) are turned into positions and documents first (`paratrain.data.micro_batch`); the
        engine does that before any split and passes `documents` itself."""
        if any(k not in ("cu_seq_lens_q", "cu_seqlens") for k in boundaries):
            raise ModelSpecError(f"{type(self.hf_model).__name__} under paratrain takes input_ids, targets, "
                                 f"position_ids, labels, attention_mask, cu_seq_lens_q; got also {sorted(boundaries)}")
        if labels is not None or attention_mask is not None or boundaries:
            given = {k: v for k, v in dict(input_ids=input_ids, targets=targets, labels=labels,
                                           attention_mask=attention_mask, position_ids=position_ids,
                                           **boundaries).items() if v is not None}
            batch = as_micro_batch((), given)
            targets, position_ids, documents = batch.targets, batch.position_ids, batch.documents
            hf_output = hf_output or labels is not None
        check_token_ids(input_ids, self.config.vocab_size, "token ids")
        position_ids = _positions(input_ids, position_ids)
        h = self.embed(input_ids, position_ids)
        extra = self.layer_kwargs(h, position_ids, documents)
        for layer in self.layers:
            out = layer(h, **extra)
            h = out[0] if isinstance(out, tuple) else out
        logits = self.final(h)
        if targets is None:
            return _hf_output(logits, None) if hf_output else logits
        check_token_ids(targets, self.config.vocab_size, "targets", ignore_index=-100)
        loss = self.loss_fn(logits, targets)
        return _hf_output(logits, loss) if hf_output else loss

    def save_pretrained(self, *args, **kwargs):
        raise ModelSpecError("save the trained model with engine.save_pretrained(dir): the engine knows which "
                             "rank holds which slice")


def _positions(input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """(b, s) positions: transformers' rotary embeddings index them per sample."""
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
    return position_ids.unsqueeze(0).expand(input_ids.shape[0], -1) if position_ids.dim() == 1 else position_ids


def _hf_output(logits: torch.Tensor, loss: torch.Tensor | None):
    """`...ForCausalLM`'s output: `.loss` (the mean over the positions with a target), `.logits`."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss, logits=logits)


def as_causal_lm(model: nn.Module) -> nn.Module:
    """The module paratrain trains for `model`: the layered view of a transformers model, else `model`."""
    return HFCausalLM(model) if is_transformers_model(model) else model
