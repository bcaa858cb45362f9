"""Context parallelism on a longer sequence: one process vs dp2 vs cp2, the same 2 x 512 tokens per step.

Besides the step time, each case times its attention kernel alone (forward + backward of one layer's
core on this rank's tokens): torch's fused causal SDPA on the whole sequence for one process and dp2,
ring attention over the cp axis for cp2 (`extra_attn_ms`).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.common import BENCH_MODEL, LocalBatches, Timer, bench_model, paratrain_optimizer, record_setup

SEQ_LEN = 512
TOKENS_PER_STEP = 2 * SEQ_LEN


def attention_ms(engine, batch: int, seq_len: int, repeats: int = 10) -> float:
    """Forward + backward of one layer's attention core on this rank's (b, heads, s/cp, head_dim)."""
    cp = engine.mesh.size("cp")
    heads, head_dim = BENCH_MODEL["n_head"], BENCH_MODEL["d_model"] // BENCH_MODEL["n_head"]
    core = engine.module.blocks[0].attn.core
    q, k, v = (torch.randn(batch, heads, seq_len // cp, head_dim, requires_grad=True) for _ in range(3))
    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        tic = time.perf_counter()
        core(q, k, v).sum().backward()
        times.append(time.perf_counter() - tic)
    return statistics.median(times[2:]) * 1e3


def paratrain_layout(steps: int, warmup: int, cp: int = 1) -> dict:
    import paratrain

    dp = dist.get_world_size() // cp
    micro = TOKENS_PER_STEP // SEQ_LEN // dp
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
           "optimizer": paratrain_optimizer(),
           "context_parallel": {"size": cp}}
    model = bench_model(seq_len=SEQ_LEN)
    engine, *_ = paratrain.initialize(model=model, config=cfg)
    batches = LocalBatches(micro, dp, engine.mesh.local_rank("dp"), seq_len=SEQ_LEN)
    timer = Timer(warmup, record_setup(engine.optimizer, model, batches))
    timer.measure(steps, lambda: engine.train_batch(batches))
    return timer.result(state_bytes=engine.memory_stats()["total"],
                        extra_attn_ms=round(attention_ms(engine, micro, SEQ_LEN), 2))


def paratrain_cp2(steps: int, warmup: int) -> dict:
    return paratrain_layout(steps, warmup, cp=2)


CASES = {
    "one process": (paratrain_layout, 1),
    "dp2": (paratrain_layout, 2),
    "cp2": (paratrain_cp2, 2),
}
BASELINE = "one process"
