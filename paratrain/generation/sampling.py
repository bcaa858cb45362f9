"""The next token of each row from its logits: greedy (argmax), or sampled after transformers' warpers in
transformers' order (temperature, then top-k, then top-p), with the caller's `torch.Generator`.

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
    scores = logits / temperature if temperature != 1.0 else logits
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - top_p)
        drop_sorted[..., -1:] = False  # always keep the most likely token
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = scores.softmax(dim=-1)
    where = generator.device if generator is not None else probs.device
    return torch.multinomial(probs.to(where), 1, generator=generator).squeeze(-1).to(logits.device)
