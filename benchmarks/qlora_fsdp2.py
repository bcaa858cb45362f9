"""The peer of `benchmarks/qlora.py`: QLoRA the way torchtune does it, torch FSDP2 over torchao's NF4, one process of
`python -m torch.distributed.run --nproc-per-node 2 benchmarks/qlora_fsdp2.py --out DIR`.

The same model as the paratrain job (`benchmarks.qlora.MODEL`: paratrain's Llama, used here as a plain nn.Module)
with every projection of its blocks replaced by torchtune's kind of layer: the frozen weight as torchao's
`NF4Tensor` (`to_nf4`, blocks of 64, scales quantized per 256 blocks), its forward `linear_nf4`, and LoRA r 8,
alpha 16 beside it (A as nn.Linear's default, B zero). `fully_shard` on every block and on the root (FSDP2 shards the
NF4 weights with their scales, the frozen fp32 weights and the adapters), fp32, torch's fused AdamW with the job's
options, clipping 1.0, the job's shapes: 4 rows of 128 tokens per rank per step, random tokens (time does not depend
on them). Writes `<out>/rank<r>.json`: the step times, and this rank's model-state bytes between steps (its shards
of every parameter, NF4 inner tensors included, its gradient shards and its optimizer state). A benchmark helper, not
paratrain's runtime.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

R, ALPHA = 8, 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class NF4LoraLinear(nn.Module):
    """torchtune's QLoRA linear layer: an NF4 frozen weight and a LoRA adapter."""

    def __init__(self, linear: nn.Linear):
        from torchao.quantization import to_nf4

        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(to_nf4(linear.weight.detach()), requires_grad=False)
        self.lora_a = nn.Linear(self.in_features, R, bias=False)
        self.lora_b = nn.Linear(R, self.out_features, bias=False)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x)) * (ALPHA / R)


def _bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`, a DTensor by its local shard, an NF4 tensor by its parts."""
    seen: dict[int, int] = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        parts = [getattr(t, name) for name in t.__tensor_flatten__()[0]] if hasattr(t, "__tensor_flatten__") else [t]
        for part in parts:
            storage = part.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def build(model_shape: dict) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    from paratrain.models.registry import build_model

    torch.manual_seed(1234)
    model = build_model("llama-tiny", **model_shape)
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in list(model.named_modules()):
        if name.endswith(TARGETS) and isinstance(module, nn.Linear):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, NF4LoraLinear(module))
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    from benchmarks.qlora import MODEL

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = build(MODEL)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    generator = torch.Generator().manual_seed(rank)
    times, state = [], None
    for _ in range(args.steps):
        rows = torch.randint(0, MODEL["vocab_size"], (4, MODEL["seq_len"] + 1), generator=generator)
        start = time.perf_counter()
        loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        times.append(time.perf_counter() - start)
        state = {"params": _bytes(model.parameters()), "grads": _bytes(p.grad for p in trainable if p.grad is not None),
                 "optimizer_state": _bytes(v for s in optimizer.state.values() for v in s.values()
                                           if isinstance(v, torch.Tensor))}
        optimizer.zero_grad()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"step_times_s": times, "state": state,
                                                             "loss": float(loss)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
