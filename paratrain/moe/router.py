"""The router of a mixture-of-experts layer and its two losses.

    router = Router(d_model, num_experts, top_k=2, score_func="softmax", norm_topk_prob=True)
    routing = router(x)                       # x (T, d): routing.experts (T, k), routing.weights (T, k)
    loss = task_loss + a * load_balancing_loss(routing.probs, routing.experts, E) + b * router_z_loss(routing.logits)

Everything after the logits is computed in float32 (as DeepSpeed's and Mixtral's gates do): the softmax over
a few experts in bf16 makes the top-k choice, and so the routing, depend on rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.errors import InvalidValueError

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class Routing:
    """One forward's routing of T tokens, k choices each."""

    experts: torch.Tensor  # (T, k) int64: the chosen experts of each token, best first
    weights: torch.Tensor  # (T, k) float32: the combine weight of each choice (differentiable: trains the router)
    probs: torch.Tensor  # (T, E) float32: the scores normalised to sum 1 per token (P_e of the balancing loss)
    logits: torch.Tensor  # (T, E) float32: x W_r (the z-loss's input)


class Router(nn.Module):
    """logits = x W_r (no bias unless `bias`); scores = softmax(logits) or sigmoid(logits) (`score_func`, the
    latter DeepSeek-V3's); the k best scores are the combine weights, divided by their sum when
    `norm_topk_prob` (Mixtral and DeepSeek-V3 do; Switch and DeepSpeed's top-1 do not)."""

    def __init__(self, d_model: int, num_experts: int, top_k: int = 2, score_func: str = "softmax",
                 norm_topk_prob: bool = True, bias: bool = False):
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise InvalidValueError(f"score_func = {score_func!r}: use one of {SCORE_FUNCS}")
        if not 1 <= top_k <= num_experts:
            raise InvalidValueError(f"top_k = {top_k} with num_experts = {num_experts}: each token picks between "
                                    f"1 and num_experts experts; set top_k in [1, {num_experts}]")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.norm_topk_prob = score_func, norm_topk_prob
        # Linear's (E, d) weight layout, named like Mixtral's `block_sparse_moe.gate.weight`
        self.gate = nn.Linear(d_model, num_experts, bias=bias)

    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.gate(x).float()  # (T, E)
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        top, experts = scores.topk(self.top_k, dim=-1)  # (T, k) each
        if self.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        # sigmoid scores do not sum to 1; the balancing loss wants a distribution over experts (DeepSeek-V3's
        # sequence-wise loss normalises them the same way)
        probs = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        return Routing(experts=experts, weights=top, probs=probs, logits=logits)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int,
                        group_size: int | None = None) -> torch.Tensor:
    """Switch / GShard's auxiliary loss: E · Σ_e f_e · P_e, where, over T tokens with k choices each,

        f_e = (1 / (T·k)) · #{(t, j) : experts[t, j] = e}    the fraction of the T·k routed choices that went
                                                                to e (every one of the k counted, before any
                                                                capacity drop; no gradient: it is a count)
        P_e = (1 / T) · Σ_t probs[t, e]                        the mean router probability of e

    Perfectly balanced routing gives 1 for every k (f_e = P_e = 1/E). Hugging Face's Mixtral loss divides by
    T, not T·k, so it is k times this one. `group_size`: computed per run of that many consecutive tokens and
    averaged over the runs (GShard's per-group loss), so each group's value depends on its tokens only and a
    layout that splits the tokens between ranks computes the same mean; None: one group of all T tokens.
    `probs` (T, E), `experts` (T, k) int64; returns a float32 scalar."""
    tokens, k = experts.shape
    group_size = tokens if group_size is None else group_size
    groups = tokens // group_size
    bucket = torch.div(torch.arange(tokens * k, device=experts.device), group_size * k, rounding_mode="floor")
    counts = torch.bincount(bucket * num_experts + experts.reshape(-1), minlength=groups * num_experts)
    fraction = counts.view(groups, num_experts).to(probs.dtype) / (group_size * k)
    mean_probs = probs.view(groups, group_size, num_experts).mean(1)
    return num_experts * (fraction * mean_probs).sum(-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: (1 / T) · Σ_t (logsumexp_e logits[t, e])², which keeps the logits small (large
    ones make the float32 softmax saturate). `logits` (T, E); returns a float32 scalar."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
