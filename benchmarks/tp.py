"""Our tensor parallelism vs torch's DTensor tensor parallelism (`parallelize_module`), 2 ranks, same GPT.

Both sides split the same layers the same way: q/k/v and fc column-wise, o and proj row-wise, the token
embedding over the vocabulary, the head over the vocabulary with a vocab-parallel loss (torch's
`loss_parallel`), q/k/v sharing one entry into the region (torch: `PrepareModuleInput` on the attention
and MLP modules, as torchtitan does). With sequence parallelism the norms hold s/tp tokens
(`SequenceParallel`), and the sequence is split after the embedding (`PrepareModuleOutput`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.common import LocalBatches, Timer, bench_model, paratrain_optimizer, record_setup, torch_adamw

MICRO_BATCH = 8
TP = 2


def _paratrain(steps: int, warmup: int, sequence_parallel: bool) -> dict:
    import paratrain

    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 1.0,
           "optimizer": paratrain_optimizer(),
           "tensor_parallel": {"size": TP, "sequence_parallel": sequence_parallel}}
    model = bench_model()
    engine, *_ = paratrain.initialize(model=model, config=cfg)
    batches = LocalBatches(MICRO_BATCH, 1, 0)  # dp = 1: both tp ranks see the same batch
    timer = Timer(warmup, record_setup(engine.optimizer, model, batches))
    timer.measure(steps, lambda: engine.train_batch(batches))
    return timer.result(state_bytes=engine.memory_stats()["total"])


def paratrain_tp(steps: int, warmup: int) -> dict:
    return _paratrain(steps, warmup, False)


def paratrain_tp_sp(steps: int, warmup: int) -> dict:
    return _paratrain(steps, warmup, True)


def _torch_plan(n_layer: int, sequence_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    outside = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    plan = {
        "embed.tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "head": ColwiseParallel(input_layouts=outside, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        plan["ln_f"] = SequenceParallel()
    for i in range(n_layer):
        b = f"blocks.{i}"
        for part in ("attn", "mlp"):
            plan[f"{b}.{part}"] = PrepareModuleInput(input_layouts=(outside,), desired_input_layouts=(Replicate(),))
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"{b}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "mlp.proj"):
            plan[f"{b}.{name}"] = RowwiseParallel(output_layouts=outside)
        if sequence_parallel:
            plan[f"{b}.ln1"] = SequenceParallel()
            plan[f"{b}.ln2"] = SequenceParallel()
    return plan


def _clip_grad_norm(model: torch.nn.Module, max_norm: float) -> None:
    """`clip_grad_norm_` for a model mixing DTensor and plain parameters (torch's refuses the mix).

    Each DTensor gradient is first brought to its parameter's layout (Partial norm gradients under
    sequence parallelism are all-reduced here rather than inside the optimizer step; a full embedding
    gradient is sliced to its shard), then one all-reduce sums the shards' squares.
    """
    from torch.distributed.tensor import DTensor

    sharded_sq, replicated_sq, grads = torch.zeros(()), torch.zeros(()), []
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor):
            if g.placements != p.placements:
                g = p.grad = g.redistribute(p.device_mesh, p.placements)
            local = g.to_local()
            if any(pl.is_shard() for pl in g.placements):
                sharded_sq += local.pow(2).sum()
            else:
                replicated_sq += local.pow(2).sum()
            grads.append(local)
        else:
            replicated_sq += g.pow(2).sum()
            grads.append(g)
    dist.all_reduce(sharded_sq)
    coef = max_norm / (float(sharded_sq + replicated_sq) ** 0.5 + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)


def _param_groups(model: torch.nn.Module) -> list[dict]:
    """DTensor parameters and plain ones (the norms without SP, the position table) in two param groups of
    the same hyper-parameters: torch's fused AdamW runs one kernel per group and refuses a mix of the two."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": group} for group in groups if group]


def _torch(steps: int, warmup: int, sequence_parallel: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    mesh = init_device_mesh("cpu", (TP,))
    model = bench_model()
    parallelize_module(model, mesh, _torch_plan(model.config.n_layer, sequence_parallel))
    opt = torch_adamw(_param_groups(model))
    batches = LocalBatches(MICRO_BATCH, 1, 0)

    def step():
        x, y = next(batches)
        with loss_parallel():
            loss = model(x, y)
            loss.backward()
        _clip_grad_norm(model, 1.0)
        opt.step()
        # torch's default (and torchtitan's): zeroing in place would be one foreach kernel over the mixed
        # DTensor / plain gradients, which torch refuses under the fused optimizer
        opt.zero_grad(set_to_none=True)
        return (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()

    timer = Timer(warmup, record_setup(opt, model, batches))
    timer.measure(steps, step)

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    state = sum(local(p).numel() * local(p).element_size() for p in model.parameters()) * 2 + sum(
        local(v).numel() * local(v).element_size() for s in opt.state.values() for v in s.values() if v.dim() > 0)
    return timer.result(state_bytes=state)


def torch_tp(steps: int, warmup: int) -> dict:
    return _torch(steps, warmup, False)


def torch_tp_sp(steps: int, warmup: int) -> dict:
    return _torch(steps, warmup, True)


CASES = {
    "paratrain TP": (paratrain_tp, TP),
    "torch TP": (torch_tp, TP),
    "paratrain TP+SP": (paratrain_tp_sp, TP),
    "torch TP+SP": (torch_tp_sp, TP),
}
BASELINE = "torch TP"
# Each of our cases against its own torch counterpart (the table's ratio column).
# Each of ours is also compared with the peer doing the same thing (sequence parallel or not).
PEERS = {"paratrain TP": ["torch TP"], "paratrain TP+SP": ["torch TP+SP"]}
