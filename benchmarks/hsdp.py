"""HSDP: ZeRO-3 sharded over 2 ranks and replicated over 2 (4 ranks), the benchmark GPT of the zero suite, for
`benchmarks.versus_commit` (whether the replicas' all-reduce beside the backward changes the step):

    python -m benchmarks.versus_commit <commit> --only hsdp --repeats 3 --steps 10 --warmup 2

4 ranks share this machine's 2 cores (oversubscribed): what the overlap can hide here is bounded by the cores the
collectives' threads find free.
"""

from __future__ import annotations

import torch.distributed as dist

from benchmarks.common import BENCH_MODEL, LocalBatches, Timer, bench_model, paratrain_optimizer, record_setup

MICRO_BATCH = 4


def paratrain_zero3_replicate2(steps: int, warmup: int) -> dict:
    import paratrain

    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "optimizer": paratrain_optimizer(), "data_parallel": {"replicate": 2},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    model = bench_model()
    engine, *_ = paratrain.initialize(model=model, config=cfg)
    batches = LocalBatches(MICRO_BATCH, dist.get_world_size(), dist.get_rank())
    timer = Timer(warmup, record_setup(engine.optimizer, model, batches))
    timer.measure(steps, lambda: engine.train_batch(batches))
    return timer.result(state_bytes=engine.memory_stats()["total"])


CASES = {"paratrain ZeRO-3, replicate 2": (paratrain_zero3_replicate2, 4)}
BASELINE = "paratrain ZeRO-3, replicate 2"
PEERS: dict = {}
REFERENCE = None
MODEL = BENCH_MODEL
