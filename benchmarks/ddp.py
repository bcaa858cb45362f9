"""Our DDP vs torch's DistributedDataParallel: same GPT, seed, data and fused AdamW with clipping. `shape`
replaces the benchmark GPT's sizes (benchmarks/overhead.py's deep, narrow model)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.common import LocalBatches, Timer, bench_model, paratrain_optimizer, record_setup, torch_adamw

MICRO_BATCH = 8


def paratrain_ddp(steps: int, warmup: int, bucket_cap_mb: float = 25.0, shape: dict | None = None) -> dict:
    import paratrain

    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 1.0,
           "optimizer": paratrain_optimizer(), "data_parallel": {"bucket_cap_mb": bucket_cap_mb}}
    model = bench_model(**(shape or {}))
    engine, *_ = paratrain.initialize(model=model, config=cfg)
    batches = LocalBatches(MICRO_BATCH, dist.get_world_size(), dist.get_rank(), seq_len=(shape or {}).get("seq_len"))
    timer = Timer(warmup, record_setup(engine.optimizer, model, batches))
    timer.measure(steps, lambda: engine.train_batch(batches))
    return timer.result(state_bytes=engine.memory_stats()["total"])


def torch_ddp(steps: int, warmup: int, bucket_cap_mb: float = 25.0, shape: dict | None = None) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    model = bench_model(**(shape or {}))
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
    opt = torch_adamw(model.parameters())
    batches = LocalBatches(MICRO_BATCH, dist.get_world_size(), dist.get_rank(), seq_len=(shape or {}).get("seq_len"))

    def step():
        x, y = next(batches)
        loss = ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # same metric cost as train_batch's global mean loss
        return mean / dist.get_world_size()

    timer = Timer(warmup, record_setup(opt, model, batches))
    timer.measure(steps, step)
    state = sum(t.numel() * t.element_size() for t in model.parameters()) * 2 + sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim() > 0)
    return timer.result(state_bytes=state)


CASES = {
    "paratrain DDP": (paratrain_ddp, 2),
    "torch DDP": (torch_ddp, 2),
}
BASELINE = "torch DDP"
