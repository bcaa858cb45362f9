"""Hugging Face GPT-2 names for the built-in GPT (`paratrain checkpoint export --hf`, through the GPT's model
spec, `GPTSpec.to_hugging_face`).

| paratrain (GPT)                         | GPT-2 (transformers `GPT2LMHeadModel`)                       |
|-----------------------------------------|--------------------------------------------------------------|
| `embed.tok.weight` (V, d)               | `transformer.wte.weight`                                     |
| `embed.pos.weight` (S, d)               | `transformer.wpe.weight`                                     |
| `blocks.i.ln1.*`, `blocks.i.ln2.*`      | `transformer.h.i.ln_1.*`, `transformer.h.i.ln_2.*`           |
| `blocks.i.attn.{q,k,v}.weight` (d, d)   | `transformer.h.i.attn.c_attn.weight` = cat(q, k, v)ᵀ (d, 3d) |
| `blocks.i.attn.o.weight` (d, d)         | `transformer.h.i.attn.c_proj.weight` = Wᵀ                    |
| `blocks.i.mlp.fc.weight` (f, d)         | `transformer.h.i.mlp.c_fc.weight` = Wᵀ (d, f)                |
| `blocks.i.mlp.proj.weight` (d, f)       | `transformer.h.i.mlp.c_proj.weight` = Wᵀ (f, d)              |
| `ln_f.*`                                | `transformer.ln_f.*`                                         |
| `head.weight` (V, d)                    | `lm_head.weight` (untied: `tie_word_embeddings: false`)      |

[Note: fused q/k/v, transposes, biases]
GPT-2 computes q, k, v with one `Conv1D` (`c_attn`) whose weight is stored (in, out) and splits its output
into q, k, v along the features, then into heads of `head_dim` each: exactly our separate q, k, v in that
order, so the fused weight is their concatenation, transposed; every other linear is transposed too. A GPT
built with `bias=False` gets zero biases (the same function). GPT-2's `lm_head` has no bias, so a GPT whose
head has one cannot be exported exactly and is refused. The activation is the tanh GELU (`gelu_new`).
"""

from __future__ import annotations

import re

import torch

from paratrain.checkpoint.format import CheckpointError
from paratrain.models.gpt.model import gpt_config

_BLOCK = re.compile(r"blocks\.(\d+)\.")


def to_gpt2(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if "head.bias" in state:
        raise CheckpointError("--hf: this GPT's output head has a bias, which GPT-2's lm_head does not, so no GPT-2 "
                              "checkpoint computes the same function; export without --hf, or train with "
                              "model_overrides {\"bias\": false}")
    expected = {"embed.tok.weight", "embed.pos.weight", "ln_f.weight", "ln_f.bias", "head.weight"}
    if not expected <= set(state):
        raise CheckpointError(f"--hf maps the built-in GPT (paratrain.models.GPT) only; this checkpoint lacks "
                              f"{sorted(expected - set(state))}")
    out = {"transformer.wte.weight": state["embed.tok.weight"], "transformer.wpe.weight": state["embed.pos.weight"],
           "transformer.ln_f.weight": state["ln_f.weight"], "transformer.ln_f.bias": state["ln_f.bias"],
           "lm_head.weight": state["head.weight"]}
    for i in range(num_layers(state)):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."

        def bias(name: str, size: int, src: str = src) -> torch.Tensor:
            b = state.get(src + name + ".bias")
            return b if b is not None else torch.zeros(size, dtype=state[src + name + ".weight"].dtype)

        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[dst + theirs + ".weight"] = state[src + ours + ".weight"]
            out[dst + theirs + ".bias"] = state[src + ours + ".bias"]
        qkv = [state[src + f"attn.{p}.weight"] for p in "qkv"]
        out[dst + "attn.c_attn.weight"] = torch.cat(qkv, 0).t().contiguous()
        out[dst + "attn.c_attn.bias"] = torch.cat([bias(f"attn.{p}", w.shape[0]) for p, w in zip("qkv", qkv)])
        for ours, theirs in (("attn.o", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            w = state[src + ours + ".weight"]
            out[dst + theirs + ".weight"] = w.t().contiguous()
            out[dst + theirs + ".bias"] = bias(ours, w.shape[0])
    return out


def num_layers(state: dict[str, torch.Tensor]) -> int:
    return len({int(m.group(1)) for k in state if (m := _BLOCK.match(k))})


def gpt2_config(state: dict[str, torch.Tensor], config: dict, n_head: int | None) -> dict:
    """GPT-2's config.json for these weights. The head count is not in any shape: it comes from `n_head`, or
    from the checkpoint's trainer config (`paratrain train`'s model and model_overrides)."""
    vocab, d = state["embed.tok.weight"].shape
    eps = 1e-5
    trainer = config.get("trainer", {})
    if n_head is None:
        try:
            cfg = gpt_config(trainer.get("model", ""), **trainer.get("model_overrides", {}))
        except (ValueError, TypeError):
            cfg = None
        if cfg is None or cfg.d_model != d or cfg.vocab_size != vocab or cfg.n_layer != num_layers(state):
            raise CheckpointError("--hf needs the number of attention heads, which the weights do not show and the "
                                  "checkpoint's trainer config does not match; pass --n-head N")
        n_head, eps = cfg.n_head, cfg.norm_eps
    if d % n_head:
        raise CheckpointError(f"--n-head {n_head} does not divide the model width {d}")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": int(vocab),
            "n_positions": int(state["embed.pos.weight"].shape[0]), "n_embd": int(d),
            "n_layer": num_layers(state), "n_head": int(n_head),
            "n_inner": int(state["blocks.0.mlp.fc.weight"].shape[0]) if num_layers(state) else None,
            "activation_function": "gelu_new", "layer_norm_epsilon": eps, "tie_word_embeddings": False,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True}
