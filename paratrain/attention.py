"""The attention core, a building block every model family can use and every strategy can replace.

    core = CausalAttentionCore(dropout)      # softmax(q kᵀ / √d) v, causal; q, k, v: (b, heads, s, head_dim)

Keeping the core (scores, softmax, values) a module of its own, behind this fixed contract, is what lets
strategies act on attention without knowing the model: context parallelism swaps in ring attention under
the same path, and selective activation checkpointing recomputes exactly this module. A model spec names
its cores (`paratrain.model_spec.ModelSpec.attention_cores`); by default every `CausalAttentionCore` is one.
Grouped-query attention passes k and v with fewer heads than q (a divisor of them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def expand_kv_heads(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: repeat each of k/v's heads so they match q's `heads` (b, heads, s, d)."""
    groups = heads // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


class CausalAttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d)) v with a causal mask. Inputs and output: (b, heads, s, head_dim)."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        k, v = expand_kv_heads(k, v, q.shape[1])
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
