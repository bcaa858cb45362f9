"""The attention core, a building block every model family can use and every strategy can replace.

    core = CausalAttentionCore(dropout)      # softmax(q kᵀ / √d) v, causal; q, k, v: (b, heads, s, head_dim)
    out = core(q, k, v, documents, window)   # packed documents / left padding, a sliding window: both optional

Keeping the core (scores, softmax, values) a module of its own, behind this fixed contract, is what lets
strategies act on attention without knowing the model: context parallelism swaps in ring attention under
the same path, and selective activation checkpointing recomputes exactly this module. A model spec names
its cores (`paratrain.model_spec.ModelSpec.attention_cores`); by default every `CausalAttentionCore` is one.
Grouped-query attention passes k and v with fewer heads than q (a divisor of them).

[Note: documents travel whole]
`Documents` says which document each token of a row belongs to (-1: padding), for the whole row, never split:
under context parallelism every attention core knows which tokens it holds (its rank's chunks, or the whole
sequence after Ulysses' all-to-all), so it can cut the masks it needs from the whole row without any
communication. Query token i may attend key token j when both are in one document, j ≤ i, and, with a
sliding window w, i − j < w (transformers' rule). A padding token attends the padding before it: its output
is never used, and every query keeps at least itself, so no softmax row is empty.

[Note: the kernel for documents]
When every document is one contiguous run of its row (packing, left padding), attention runs once per run,
causal, with torch's fused kernel (a "varlen" attention built from ordinary calls): it computes only the
pairs inside documents, fewer than causal attention over the whole row, where a mask over the row would
compute every block and cost about 1.8x plain causal attention on this CPU (benchmarks/real_data.py measures
both). The runs are read to the host once per micro-batch and cached. A sliding window, or document ids that
come back after another document, use the element-wise mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.errors import InvalidValueError

PADDING = -1  # the document id of a padding token


def expand_kv_heads(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: repeat each of k/v's heads so they match q's `heads` (b, heads, s, d)."""
    groups = heads // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


@dataclass(eq=False)
class Documents:
    """Document ids (b, s) of whole rows (`PADDING` for padding tokens). Masks cut from them are cached on the
    object, which lives for one micro-batch: every layer (and a recomputation in backward) reuses them."""

    ids: torch.Tensor
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    def to(self, device: torch.device) -> Documents:
        """The ids on `device`; the runs, once read (from host memory, `paratrain.data.token_layout`), come along."""
        if self.ids.device == device:
            return self
        return Documents(self.ids.to(device, non_blocking=True),
                         {"runs": self._masks["runs"]} if "runs" in self._masks else {})

    def runs(self) -> list[list[tuple[int, int]]] | None:
        """Per row, the (start, end) of each run of equal ids; None when some id has more than one run."""
        if "runs" not in self._masks:
            ids = self.ids.cpu()
            starts = torch.ones_like(ids, dtype=torch.bool)
            starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
            rows = []
            for r in range(ids.shape[0]):
                bounds = starts[r].nonzero().flatten().tolist() + [ids.shape[1]]
                if len(bounds) - 1 != len(set(ids[r].tolist())):
                    rows = None
                    break
                rows.append(list(zip(bounds, bounds[1:])))
            self._masks["runs"] = rows
        return self._masks["runs"]

    def allowed(self, key, queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
        """(b, 1, len(queries), len(keys)) bool: which (query, key) pairs may attend, for the global token
        indices `queries` and `keys` of the row. `key` names the pair for the cache (with the window)."""
        cache_key = (key, window)
        mask = self._masks.get(cache_key)
        if mask is None:
            mask = allowed_pairs(self.ids, queries, keys, window)
            self._masks[cache_key] = mask
        return mask


def allowed_pairs(ids: torch.Tensor | None, queries: torch.Tensor, keys: torch.Tensor,
                  window: int | None) -> torch.Tensor:
    """The mask rule of the note above for global indices `queries` (sq,) and `keys` (sk,): (b|1, 1, sq, sk)."""
    distance = queries.unsqueeze(-1) - keys.unsqueeze(0)  # (sq, sk)
    mask = distance >= 0
    if window is not None:
        mask = mask & (distance < window)
    mask = mask.unsqueeze(0).unsqueeze(0)  # (1, 1, sq, sk)
    if ids is None:
        return mask
    q_docs, k_docs = ids[:, queries.to(ids.device)], ids[:, keys.to(ids.device)]  # (b, sq), (b, sk)
    return mask.to(ids.device) & (q_docs.unsqueeze(-1) == k_docs.unsqueeze(-2)).unsqueeze(1)


def check_window(window) -> int | None:
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise InvalidValueError(f"sliding window must be a positive number of tokens, got {window!r}")
    return window


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None,
                     window: int | None, dropout: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """Attention over one whole row's tokens (b, heads, s, d): plain causal SDPA when there is nothing to mask
    but the future, else SDPA with the mask of the note above."""
    window = check_window(window)
    s = q.shape[-2]
    if window is not None and window >= s:
        window = None  # a window no shorter than the sequence masks nothing
    if documents is None and window is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale)
    if documents is not None and documents.length != s:
        raise InvalidValueError(f"attention over {s} tokens got document ids for rows of {documents.length}: "
                                f"the attention core must see whole rows (under context parallelism the core is "
                                f"replaced by one that knows its tokens)")
    runs = documents.runs() if documents is not None and window is None else None
    if runs is not None:  # one causal attention per document (see the note)
        rows = [torch.cat([F.scaled_dot_product_attention(q[r:r + 1, :, a:b], k[r:r + 1, :, a:b], v[r:r + 1, :, a:b],
                                                          dropout_p=dropout, is_causal=True, scale=scale)
                           for a, b in spans], dim=2) for r, spans in enumerate(runs)]
        return torch.cat(rows, dim=0)
    index = torch.arange(s, device=q.device)
    mask = documents.allowed("whole", index, index, window) if documents is not None else \
        allowed_pairs(None, index, index, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)


class CausalAttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d)) v with a causal mask (and `documents`, `window` when given). Inputs and
    output: (b, heads, s, head_dim)."""

    kv_cache = None  # generation attaches a cache (`paratrain.generation.kv_cache`): the core then attends the
    # new tokens to every cached one, and the cache's rows say which positions are padding

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None,
                window: int | None = None) -> torch.Tensor:
        if self.kv_cache is not None:
            return self.kv_cache.attend(q, k, v, window)
        p = self.dropout if self.training else 0.0
        k, v = expand_kv_heads(k, v, q.shape[1])
        return masked_attention(q, k, v, documents, window, dropout=p)
