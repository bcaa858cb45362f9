"""DeepSpeed's deepspeed.moe.layer.MoE and paratrain's, from the same weights, on the same input: prints one
JSON line per case with the largest differences of output, l_aux, exp_counts and the gradients. Run in its own
process (tests/distributed/test_deepspeed_compat.py): DeepSpeed's MoE needs a process group (a one-process gloo
world).

Only deterministic cases: DeepSpeed's random token selection and Gumbel sampling are off, and top-1 drops no
tokens (without random selection DeepSpeed keeps a top-k of tied 0/1 scores, whose order torch leaves open)."""

import json
import os

import deepspeed
import torch
from deepspeed.moe.layer import MoE as DSMoE
from torch import nn

import paratrain

CASES = [
    dict(k=1, drop_tokens=False),
    dict(k=1, capacity_factor=4.0),  # capacity above every count: the capacity path, nothing dropped
    dict(k=2, drop_tokens=False),
    dict(k=2, capacity_factor=0.5, min_capacity=1),  # DeepSpeed's top-2 drops in token order: comparable
    dict(k=2, capacity_factor=1.0, min_capacity=1, use_residual=True),
]


def _copy(ds: nn.Module, ours: nn.Module, num_experts: int) -> None:
    experts = ds.deepspeed_moe.experts.deepspeed_experts
    with torch.no_grad():
        ours.deepspeed_moe.gate.wg.weight.copy_(ds.deepspeed_moe.gate.wg.weight)
        for i, index in enumerate((0, 2)):  # the Sequential's two Linears
            for e in range(num_experts):
                ours.deepspeed_moe.experts.weights[i][e].copy_(experts[e][index].weight)
                ours.deepspeed_moe.experts.biases[i][e].copy_(experts[e][index].bias)
        if hasattr(ds, "coefficient"):
            ours.coefficient.load_state_dict(ds.coefficient.state_dict())
            ours.mlp.load_state_dict(ds.mlp.state_dict())


def _grads(moe: nn.Module, x: torch.Tensor):
    out, l_aux, counts = moe(x)
    weight = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * weight).sum().add(0.1 * l_aux).backward()
    return out, l_aux, counts


def compare(case: dict) -> dict:
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6))
    options = dict(num_experts=4, use_rts=False, top2_2nd_expert_sampling=False, **case)
    ds = DSMoE(6, expert, **options)
    ds.set_deepspeed_parallelism()
    with torch.no_grad():  # DeepSpeed's copies start equal; make them differ so a mixed-up expert shows
        for p in ds.deepspeed_moe.experts.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ours = paratrain.moe.layer.MoE(6, nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6)), **options)
    _copy(ds, ours, 4)
    x = torch.randn(3, 8, 6)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = _grads(ds, xa), _grads(ours, xb)
    gate_a, gate_b = ds.deepspeed_moe.gate.wg.weight.grad, ours.deepspeed_moe.gate.wg.weight.grad
    expert_a = torch.stack([e[0].weight.grad for e in ds.deepspeed_moe.experts.deepspeed_experts])
    return {"case": case, "out": (a[0] - b[0]).abs().max().item(), "l_aux": abs(a[1].item() - b[1].item()),
            "counts": [a[2].tolist(), b[2].tolist()], "x_grad": (xa.grad - xb.grad).abs().max().item(),
            "gate_grad": (gate_a - gate_b).abs().max().item(),
            "expert_grad": (expert_a - ours.deepspeed_moe.experts.weights[0].grad).abs().max().item(),
            "out_scale": a[0].abs().max().item()}


if __name__ == "__main__":
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed("gloo")
    for case in CASES:
        print(json.dumps(compare(case)), flush=True)
