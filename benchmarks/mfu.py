"""Model FLOPs utilization of a GPT training step, under two conventions reported side by side.

Primary, Megatron-LM's and PaLM's (Narayanan et al. 2021, Chowdhery et al. 2022, appendix B): per token,
6·N with N the parameters *excluding the embedding lookups* (the token and position tables: a lookup is a
gather, not a matmul; the untied output head is a matmul and counts), plus the attention term 12·L·h·s
(QKᵀ and AV, forward and backward) counted over the full s × s score matrix, as PaLM counts it, although a
causal mask makes half of it unnecessary. Counting the causal half instead would be 6·L·h·s.

Old (all parameters): 6·N over every parameter, embedding tables included, plus the same attention term;
what this repository reported before issue 14 (`GPTConfig.flops_per_token`), kept beside the primary so old
and new numbers can be compared, never instead of it.
"""

from __future__ import annotations

from paratrain.models import GPTConfig

H100_BF16_DENSE_TFLOPS = 989.0  # the dense bf16 peak of an H100/H200 SXM (datasheet)
PRIMARY, OLD = "megatron", "all_params"


def embedding_lookup_params(cfg: GPTConfig) -> int:
    """Parameters used by lookup, not matmul: the token table (vocab × d) and the position table (seq × d)."""
    return cfg.vocab_size * cfg.d_model + cfg.seq_len * cfg.d_model


def attention_flops_per_token(cfg: GPTConfig) -> int:
    """QKᵀ and AV over the full s × s scores: 2·(2·s·h) per layer forward, ×3 with backward."""
    return 12 * cfg.n_layer * cfg.d_model * cfg.seq_len


def flops_per_token(cfg: GPTConfig, convention: str = PRIMARY) -> int:
    """Training FLOPs per token under `convention` (PRIMARY or OLD, see the module docstring)."""
    if convention == PRIMARY:
        weights = cfg.num_params() - embedding_lookup_params(cfg)
    elif convention == OLD:
        weights = cfg.num_params()
    else:
        raise ValueError(f"MFU convention {convention!r}: use {PRIMARY!r} or {OLD!r}")
    return 6 * weights + attention_flops_per_token(cfg)


def mfu_report(cfg: GPTConfig, tokens_per_s: float, peak_tflops: float = H100_BF16_DENSE_TFLOPS) -> dict:
    """Both conventions for one measured throughput: FLOPs per token, achieved TFLOP/s and MFU."""
    out = {"mfu_convention": f"{PRIMARY}: 6 x non-embedding parameters + 12 x layers x d_model x seq "
                             f"(attention counted full, as PaLM); {OLD}: 6 x all parameters + the same attention",
           "peak_tflops": peak_tflops, "non_embedding_params": cfg.num_params() - embedding_lookup_params(cfg)}
    for convention in (PRIMARY, OLD):
        suffix = "" if convention == PRIMARY else f"_{OLD}"
        per_token = flops_per_token(cfg, convention)
        out[f"flops_per_token{suffix}"] = per_token
        out[f"achieved_tflops{suffix}"] = tokens_per_s * per_token / 1e12
        out[f"mfu{suffix}"] = tokens_per_s * per_token / (peak_tflops * 1e12)
    return out
