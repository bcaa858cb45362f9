"""The tensor-parallel plan of a Hugging Face model, from its own config or from its module names.

transformers models that support tensor parallelism carry a plan in their config (`base_model_tp_plan`,
patterns under the base model, e.g. `layers.*.self_attn.q_proj: colwise`). paratrain translates its styles
into ours and adds what the HF plan leaves to DTensor but a plan over plain tensors must say: the token
table and head split over the vocabulary with the vocab-parallel loss, one region entry per attention and MLP
(q, k, v share one copy / all-gather), the attention core inside the region, and the norms on s/tp tokens
under sequence parallelism.

| transformers style | paratrain style | why |
|---|---|---|
| `colwise`, `local_colwise` | `colwise` | output features (heads) split |
| `rowwise`, `local_rowwise`, `rowwise_rep` | `rowwise` | input features split, output summed |
| `colwise_rep`, `colwise_gather_output`, `gather` | `colwise_gather` | split, output gathered back |
| `sequence_parallel` | `sequence` | runs on s/tp tokens |
| `replicate`, `local` | `replicate` | deliberately whole |

A model without a plan gets one from the names of its decoder layer's linear layers (`RULES`: q/k/v/o,
gate/up/down, fc1/fc2, ...). A linear layer that fits no rule is refused by name, with the config entry to
write.

Mixture-of-experts blocks (Mixtral's and Qwen-MoE's `mlp`: router, experts, shared expert and its gate) stay
whole on every tp rank, as in paratrain's own MoE Llama: the plan marks each block 'sequence', so under
sequence parallelism it routes this rank's s/tp tokens and its gradients are summed over tp. The config's
entries inside those blocks (`packed_colwise` experts, `moe_tp_experts`, a dense MLP's `mlp.gate_proj` that
only dense layers have) are dropped for the MoE layers and kept, per layer, for the dense ones.
"""

from __future__ import annotations

import copy

from torch import nn

from paratrain.adapters import LoraLinear
from paratrain.model_spec import ModelSpecError
from paratrain.models.hf.model import HFCausalLM, attention_modules
from paratrain.models.hf.moe import moe_blocks
from paratrain.parallel.tp.plan import match

HF_STYLES = {
    "colwise": "colwise", "local_colwise": "colwise",
    "rowwise": "rowwise", "local_rowwise": "rowwise", "rowwise_rep": "rowwise",
    "colwise_rep": "colwise_gather", "colwise_gather_output": "colwise_gather", "gather": "colwise_gather",
    "sequence_parallel": "sequence", "replicate": "replicate", "local": "replicate",
}

# Linear layers of a decoder layer by name (the last path component), for models without an HF plan.
RULES = {
    "colwise": ("q_proj", "k_proj", "v_proj", "query", "key", "value", "q", "k", "v", "wq", "wk", "wv",
                "gate_proj", "up_proj", "fc1", "fc_in", "w1", "w3", "c_fc"),
    "rowwise": ("o_proj", "out_proj", "o", "wo", "dense", "down_proj", "fc2", "fc_out", "w2", "c_proj"),
}
# Packed projections laid out [q; k; v] (or [gate; up]) along their outputs: split part by part. Others
# (GPT-NeoX's query_key_value interleaves heads) are refused by name.
PACKED_QKV = ("qkv_proj", "c_attn", "W_pack")
PACKED_HALVES = ("gate_up_proj",)
PACKED_OTHER = ("query_key_value", "Wqkv")


def _layer_prefix(model: HFCausalLM) -> str:
    return f"{model.layout.base}.{model.layout.layers}.*"


def _from_config(model: HFCausalLM) -> dict[str, str] | None:
    hf_plan = getattr(model.config, "base_model_tp_plan", None)
    if not hf_plan:
        return None
    out = {}
    for pattern, style in _outside_moe_blocks(model, {f"{model.layout.base}.{p}": s for p, s in hf_plan.items()}):
        pattern = pattern.removeprefix(f"{model.layout.base}.")
        packed = _packed_style(model, pattern)
        if packed is not None:  # transformers gathers a packed output (and splits o_proj's input): we split parts
            out[f"{model.layout.base}.{pattern}"] = packed
            continue
        if style == "rowwise_split_input":
            style = "rowwise"  # its input comes from a packed layer split part by part, so it is already split
        if style not in HF_STYLES:
            raise ModelSpecError(f"{type(model.hf_model).__name__}'s base_model_tp_plan gives '{pattern}' the style "
                                 f"'{style}', which paratrain does not translate; write tensor_parallel.plan in the "
                                 f"config (styles: {sorted(set(HF_STYLES.values()))})")
        out[f"{model.layout.base}.{pattern}"] = HF_STYLES[style]
    return out


def _from_names(model: HFCausalLM) -> dict[str, str]:
    """Every decoder layer's linear layers outside MoE blocks (a dense layer after MoE ones has its own)."""
    prefix = _layer_prefix(model)
    out = {}
    found = [(n, m) for layer in model.layers for blocks in [moe_blocks(layer) + _adapter_layers(layer)]
             for n, m in layer.named_modules() if not any(n.startswith(f"{b}.") for b in blocks)]
    for name, module in found:
        if not name or not _is_linear(module) or f"{prefix}.{name}" in out:
            continue
        last = name.rsplit(".", 1)[-1]
        style = _packed_style(model, name) or next((s for s, names in RULES.items() if last in names), None)
        if style is None:
            write = f'"{prefix}.{name}": "colwise" | "rowwise" | "replicate"'
            what = "a packed projection whose layout paratrain does not know" if last in PACKED_OTHER else \
                "no rule knows its name"
            raise ModelSpecError(f"tensor parallelism on {type(model.hf_model).__name__}: '{prefix}.{name}' "
                                 f"({type(module).__name__}) is {what}; write tensor_parallel.plan in the config "
                                 f"with {write} for it (and every other layer), or use tensor_parallel.size 1")
        out[f"{prefix}.{name}"] = style
    return out


def _outside_moe_blocks(model: HFCausalLM, plan: dict[str, str]) -> list[tuple[str, str]]:
    """`plan`'s entries with the MoE blocks taken out: a decoder-layer pattern that reaches into a layer's MoE
    block is kept only for the layers where it names a module outside one (concrete per-layer patterns)."""
    prefix = _layer_prefix(model)
    per_layer = [(i, moe_blocks(layer), [n for n, _ in layer.named_modules() if n])
                 for i, layer in enumerate(model.layers)]
    if not any(blocks for _, blocks, _ in per_layer):
        return list(plan.items())
    out = []
    for pattern, style in plan.items():
        rest = pattern[len(prefix) + 1:] if pattern.startswith(f"{prefix}.") else None
        if rest is None:
            out.append((pattern, style))
            continue
        kept = [i for i, blocks, names in per_layer if _outside(rest, blocks, names)]
        if len(kept) == len(per_layer):
            out.append((pattern, style))
        else:
            out += [(f"{model.layout.base}.{model.layout.layers}.{i}.{rest}", style) for i in kept]
    return out


def _outside(pattern: str, blocks: list[str], names: list[str]) -> bool:
    """Whether `pattern` names modules of a decoder layer (`names`), none of them in or at its MoE `blocks`."""
    hits = [n for n in names if match(pattern, n)]
    return bool(hits) and not any(n == b or n.startswith(f"{b}.") for n in hits for b in blocks)


def _is_linear(module: nn.Module) -> bool:
    """A linear layer, or an adapter layer around one (planned as its base; tp/lora.py splits its adapters)."""
    return isinstance(module, (nn.Linear, LoraLinear)) or type(module).__name__ == "Conv1D"


def _adapter_layers(layer: nn.Module) -> list[str]:
    """The adapter layers of a decoder layer: planned whole, their insides (base, A, B) never on their own."""
    return [name for name, module in layer.named_modules() if isinstance(module, LoraLinear)]


def _parents(plan: dict[str, str]) -> set[str]:
    """The modules whose input enters the region once: the parent of each colwise layer below the layer."""
    out = set()
    for pattern, style in plan.items():
        parent = pattern.rsplit(".", 1)[0]
        if (style == "colwise" or style.startswith("colwise:")) and not parent.endswith("*"):
            out.add(parent)
    return out


def hf_tp_plan(model: HFCausalLM) -> dict[str, str]:
    """The full paratrain plan: the model's own (translated) or the name rules', plus vocabulary, regions,
    cores and norms."""
    layers = _from_config(model) or dict(_outside_moe_blocks(model, _from_names(model)))
    base, layout, prefix = model.layout.base, model.layout, _layer_prefix(model)
    plan = {f"{base}.{layout.embed}": "vocab" if layout.positions else "vocab_scatter"}
    if layout.positions and layout.dropout:  # GPT-2: the sum of both tables enters the sequence shard here
        plan[f"{base}.{layout.dropout}"] = "sequence_scatter"
    plan.update({parent: "region_input" for parent in sorted(_parents(layers))})
    plan.update(layers)
    attn_name = next(n for n, m in model.layers[0].named_children() if m is attention_modules(model.layers)[0])
    plan[f"{prefix}.{attn_name}.core"] = "in_region"
    for name, child in model.layers[0].named_children():
        if "norm" in type(child).__name__.lower() or name.startswith(("ln", "norm")):
            plan[f"{prefix}.{name}"] = "sequence"
    plan[f"{base}.{layout.norm}"] = "sequence"
    for i, layer in enumerate(model.layers):  # MoE blocks: whole, on s/tp tokens under SP (the module's note)
        plan.update({f"{base}.{layout.layers}.{i}.{block}": "sequence" for block in moe_blocks(layer)})
    plan[layout.head] = "colwise_vocab"
    plan["loss_fn"] = "vocab_loss"
    return plan


def _packed_style(model: HFCausalLM, pattern: str) -> str | None:
    """'colwise:q,k,v' for a packed q/k/v projection, 'colwise:f,f' for a packed gate/up one, else None."""
    last = pattern.rsplit(".", 1)[-1]
    if last in PACKED_HALVES:
        ff = model.config.intermediate_size
        return f"colwise:{ff},{ff}"
    if last not in PACKED_QKV:
        return None
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return f"colwise:{heads * head_dim},{kv * head_dim},{kv * head_dim}"


def localize_attention(model: HFCausalLM, tp: int) -> None:
    """After tensor parallelism: an attention module that cuts a packed projection's output by its config's
    head counts (Phi-3) or by a split size (GPT-2) must use this rank's."""
    for attn in attention_modules(model.layers):
        packed = any(getattr(m, "parts", None) for m in attn.modules())  # a split packed layer inside
        if tp == 1 or not packed or getattr(attn, "_paratrain_local_heads", False):
            continue
        if hasattr(attn, "split_size"):
            attn.split_size //= tp
        if getattr(attn, "config", None) is model.config:
            local = copy.copy(model.config)
            for field in ("num_attention_heads", "num_key_value_heads"):
                if getattr(local, field, None):
                    setattr(local, field, getattr(local, field) // tp)
            attn.config = local
        for field in ("num_key_value_heads", "num_heads"):
            if isinstance(getattr(attn, field, None), int):
                setattr(attn, field, getattr(attn, field) // tp)
        attn._paratrain_local_heads = True


def supports_sequence_parallel(model: HFCausalLM) -> bool:
    """GPT-2-style models add a position table after the token table; without a dropout after it there is no
    module whose output could enter the sequence shard."""
    return not model.layout.positions or bool(model.layout.dropout)
