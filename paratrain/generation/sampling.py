"""The next token of each row from its logits: greedy (argmax), or sampled after transformers' warpers in
transformers' order (temperature, then top-k, then top-p), with the caller's `torch.Generator`, or, for rollouts,
keyed by each row (`keyed_next_tokens`, the note below).

Every rank computes the same logits (the layouts are exact), so every rank chooses the same token; sampling
draws on the host from the caller's generator, so a seeded generator gives the same tokens in every layout.
"""

from __future__ import annotations

import torch


def next_tokens(logits: torch.Tensor, do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """(b, V) logits -> (b,) token ids."""
    logits = logits.float()
    if not do_sample:
        return logits.argmax(dim=-1)
    scores = warped_scores(logits, temperature, top_k, top_p)
    probs = scores.softmax(dim=-1)
    where = generator.device if generator is not None else probs.device
    return torch.multinomial(probs.to(where), 1, generator=generator).squeeze(-1).to(logits.device)


# [Note: keyed sampling]
# A rollout's token is a function of its row's key (seed, step, global prompt index, generation index) and of the
# token's index in the completion, never of which rank holds the row or which rows share its batch: each draw is a
# uniform number hashed from (key, index) on the device, and the token is where it falls in the row's cumulative
# probabilities (after transformers' warpers). Every layout computes the same logits, so every layout samples the
# same completions, and a run resumed at a step draws what the first run drew there.
_MASK32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2^32) (lowbias32's shape; multipliers below 2^31 keep every
    product inside int64)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x446CA68B) & _MASK32
    return x ^ (x >> 16)


def keyed_uniform(keys: torch.Tensor, index: int) -> torch.Tensor:
    """(b, k) non-negative int64 keys and a draw index -> (b,) float64 uniform in [0, 1), 53 random bits."""
    h = torch.zeros(keys.shape[0], dtype=torch.int64, device=keys.device)
    for column in keys.long().unbind(dim=1):
        h = _mix(_mix(h ^ (column & _MASK32)) ^ (column >> 32))
    h = _mix(h ^ (index & _MASK32))
    low = _mix(h ^ 0x1E3779B9)
    return (h * 2**21 + (low >> 11)).double() / 2**53


def warped_scores(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """transformers' warpers in its order: temperature, top-k, top-p (filtered tokens at -inf)."""
    scores = logits.float() / temperature if temperature != 1.0 else logits.float()
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - top_p)
        drop_sorted[..., -1:] = False  # always keep the most likely token
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return scores


def keyed_next_tokens(logits: torch.Tensor, keys: torch.Tensor, index: int, temperature: float = 1.0,
                      top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """(b, V) logits -> (b,) tokens sampled by each row's key and the token's index (the note)."""
    cumulative = warped_scores(logits, temperature, top_k, top_p).softmax(dim=-1).double().cumsum(dim=-1)
    draw = keyed_uniform(keys, index) * cumulative[:, -1]
    # token i when cumulative[i-1] <= draw < cumulative[i]: a token of probability 0 is never drawn
    token = torch.searchsorted(cumulative, draw[:, None], right=True).squeeze(1)
    return token.clamp(max=logits.shape[-1] - 1)
