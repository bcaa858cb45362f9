"""The expert-parallelism benchmark's model (`benchmarks/moe.py` says what it measures): token embedding -> L
blocks of [RMSNorm -> MoE] with residuals -> RMSNorm -> head, built either with paratrain's `MoELayer` or with
DeepSpeed's `MoE` copying every weight of the paratrain model of the same seed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import SEED

MODEL = dict(vocab_size=256, d_model=192, n_layer=2, num_experts=8, d_ff=384, top_k=2)
AUX_COEF = 0.01


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SwiGLUExpert(nn.Module):
    """DeepSpeed's expert module: one SwiGLU, nn.Linear without biases (DeepSpeed deep-copies it per expert)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=False)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoEBench(nn.Module):
    """embedding -> n_layer x (x + MoE(RMSNorm(x))) -> RMSNorm -> head; `forward(idx, targets)` -> loss.
    `deepspeed_ep`: build the MoE blocks as DeepSpeed's MoE with that ep_size (None: paratrain's MoELayer)."""

    def __init__(self, deepspeed_ep: int | None = None, vocab_size=256, d_model=192, n_layer=2, num_experts=8,
                 d_ff=384, top_k=2):
        super().__init__()
        self.deepspeed = deepspeed_ep is not None
        self.embed = nn.Embedding(vocab_size, d_model)
        self.norms = nn.ModuleList(RMSNorm(d_model) for _ in range(n_layer))
        if self.deepspeed:
            from deepspeed.moe.layer import MoE

            self.moes = nn.ModuleList(
                MoE(d_model, expert=SwiGLUExpert(d_model, d_ff), num_experts=num_experts, ep_size=deepspeed_ep,
                    k=top_k, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False,
                    noisy_gate_policy=None, min_capacity=0) for _ in range(n_layer))
        else:
            from paratrain.moe import MoELayer

            self.moes = nn.ModuleList(
                MoELayer(d_model, num_experts, d_ff, top_k, score_func="softmax", norm_topk_prob=True,
                         capacity_factor=None) for _ in range(n_layer))
        self.norm_f = RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx, targets):
        x = self.embed(idx)
        aux = []
        for norm, moe in zip(self.norms, self.moes):
            out = moe(norm(x))
            x = x + out[0]
            aux.append(out[1])
        logits = self.head(self.norm_f(x))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return loss + AUX_COEF * torch.stack(aux).mean()


def paratrain_model(seed: int = SEED) -> MoEBench:
    torch.manual_seed(seed)
    model = MoEBench(**MODEL)
    model.init_seed = seed  # recorded by record_setup
    return model


def deepspeed_model(ep_size: int, ep_rank: int, seed: int = SEED) -> MoEBench:
    """DeepSpeed's MoE model with every weight of `paratrain_model(seed)`: its local experts are the global
    experts [ep_rank * E/ep, (ep_rank + 1) * E/ep), as DeepSpeed numbers them."""
    source = paratrain_model(seed)
    model = MoEBench(deepspeed_ep=ep_size, **MODEL)
    local = MODEL["num_experts"] // ep_size
    with torch.no_grad():
        model.embed.weight.copy_(source.embed.weight)
        model.head.weight.copy_(source.head.weight)
        model.norm_f.weight.copy_(source.norm_f.weight)
        for norm, src_norm in zip(model.norms, source.norms):
            norm.weight.copy_(src_norm.weight)
        for moe, src in zip(model.moes, source.moes):
            moe.deepspeed_moe.gate.wg.weight.copy_(src.gate.gate.weight)
            for i, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                e = ep_rank * local + i
                expert.gate.weight.copy_(src.experts.gate_proj[e])
                expert.up.weight.copy_(src.experts.up_proj[e])
                expert.down.weight.copy_(src.experts.down_proj[e])
    model.init_seed = seed
    return model
