"""A KV cache kept by each attention core, so generation works in any layout without knowing the model.

Every strategy acts on attention through the core (`paratrain.attention.CausalAttentionCore`): tensor
parallelism hands it this rank's heads, ZeRO-3 gathers the projections around it, a pipeline stage holds its
own layers' cores, an MoE layer sits beside it. A cache attached to each core (`core.kv_cache`) therefore
holds exactly what that rank computes, in every layout: this rank's heads of its own layers. The model's
forward stays the training forward: each call brings the new tokens' q, k, v (after the rotary embedding),
the core appends k and v and attends the new queries to every cached key.

[Note: the rows' layout during generation]
`DecodeRows` holds the document id of every position generated so far (transformers' left padding: -1 for
a pad, 0 for a real token), shared by every core: query i (global index) attends key j when j <= i, both
are in one document, and i - j < window. Padding added after a token (sequence parallelism needs a multiple
of tp tokens per forward) is a pad too: no later query attends it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.attention import CausalAttentionCore, allowed_pairs, check_window, expand_kv_heads


class DecodeRows:
    """The document ids (b, L) of every position so far and how many of them the cores have seen. `capacity`:
    the positions a decode can reach (its caches are allocated to it once; None: grown as needed)."""

    def __init__(self, ids: torch.Tensor, capacity: int | None = None):
        self.ids = ids  # (b, L): -1 padding, 0 real
        self.seen = 0  # positions already in the caches (the next forward's first global index)
        self.capacity = capacity
        self._masks: dict = {}  # this forward's masks by window: every layer of the forward asks for the same

    def extend(self, ids: torch.Tensor) -> None:
        self.ids = torch.cat([self.ids, ids], dim=1)
        self._masks = {}

    def mask(self, new: int, window: int | None, device: torch.device) -> torch.Tensor:
        """(b, 1, new, L) which cached positions the forward's `new` queries may attend (the module's note)."""
        if window not in self._masks:
            total = self.ids.shape[1]
            queries = torch.arange(self.seen, self.seen + new, device=device)
            self._masks[window] = allowed_pairs(self.ids, queries, torch.arange(total, device=device), window)
        return self._masks[window]


class KVCache:
    """One core's keys and values (b, kv_heads, capacity, d), allocated once to the rows' capacity and written in
    place: the first `rows.seen` positions are the cached ones."""

    def __init__(self, rows: DecodeRows):
        self.rows = rows
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
        """The new positions' attention over every cached position and themselves: (b, heads, s_new, d)."""
        start, end = self.rows.seen, self.rows.seen + k.shape[2]
        if self.k is None or end > self.k.shape[2]:  # first call, or beyond the capacity: (re)allocate
            self.k, self.v = self._allocated(self.k, k, end), self._allocated(self.v, v, end)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        mask = self.rows.mask(q.shape[2], check_window(window), q.device)
        keys_all, values_all = expand_kv_heads(self.k[:, :, :end], self.v[:, :, :end], q.shape[1])
        return F.scaled_dot_product_attention(q, keys_all, values_all, attn_mask=mask)

    def _allocated(self, cached: torch.Tensor | None, new: torch.Tensor, end: int) -> torch.Tensor:
        length = max(end, self.rows.capacity or 0)
        buffer = new.new_empty(new.shape[:2] + (length,) + new.shape[3:])
        if cached is not None:
            buffer[:, :, :self.rows.seen] = cached[:, :, :self.rows.seen]
        return buffer


def attention_cores(module: nn.Module) -> list[CausalAttentionCore]:
    return [m for m in module.modules() if isinstance(m, CausalAttentionCore)]


@contextmanager
def kv_caches(module: nn.Module, rows: DecodeRows):
    """Attach a cache to every attention core of `module` for the duration (removed after, also on error)."""
    cores = attention_cores(module)
    for core in cores:
        core.kv_cache = KVCache(rows)
    try:
        yield cores
    finally:
        for core in cores:
            core.kv_cache = None
