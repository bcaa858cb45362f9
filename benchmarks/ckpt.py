"""Activation checkpointing: what recomputation costs in step time and saves in kept activations.

The same 2-process layouts (dp2, and tp2 with sequence parallelism; 8 sequences of 128 tokens per step, so
every case trains on the same batches) with checkpointing off, selective
(attention cores recomputed) and full (every block recomputed). `extra_kept_act_mib` is what autograd keeps
for backward over one micro-batch's forward on one rank (distinct storages, parameters excluded), counted
with saved-tensor hooks: the number the planner's activation formulas predict.
"""

from __future__ import annotations

import torch.distributed as dist

from benchmarks.common import BENCH_MODEL, LocalBatches, Timer, bench_model, paratrain_optimizer, record_setup
from paratrain.testing.activations import saved_activation_bytes

GLOBAL_BATCH = 8  # samples per step in every case (dp2: 4 per rank; tp2: 8 on the one replica)


def _kept_activation_bytes(engine, batch) -> int:
    holder = {}
    kept = saved_activation_bytes(lambda: holder.setdefault("loss", engine(*batch)), engine.module.parameters())
    engine.backward(holder["loss"])
    engine.step()
    return kept


def _layout(steps: int, warmup: int, ckpt: str = "none", tp: int = 1) -> dict:
    import paratrain

    dp = dist.get_world_size() // tp
    micro = GLOBAL_BATCH // dp
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
           "optimizer": paratrain_optimizer(),
           "tensor_parallel": {"size": tp, "sequence_parallel": tp > 1},
           "activation_checkpointing": {"enabled": ckpt != "none",
                                        "granularity": ckpt if ckpt != "none" else "full"}}
    model = bench_model()
    engine, *_ = paratrain.initialize(model=model, config=cfg)
    batches = LocalBatches(micro, dp, engine.mesh.local_rank("dp"))
    timer = Timer(warmup, record_setup(engine.optimizer, model, batches))
    timer.measure(steps, lambda: engine.train_batch(batches))
    kept = _kept_activation_bytes(engine, next(batches))
    return timer.result(state_bytes=engine.memory_stats()["total"], extra_kept_act_mib=round(kept / 2**20, 2))


def dp2_selective(steps: int, warmup: int) -> dict:
    return _layout(steps, warmup, "selective")


def dp2_full(steps: int, warmup: int) -> dict:
    return _layout(steps, warmup, "full")


def tp2_sp(steps: int, warmup: int) -> dict:
    return _layout(steps, warmup, tp=2)


def tp2_sp_full(steps: int, warmup: int) -> dict:
    return _layout(steps, warmup, "full", tp=2)


CASES = {
    "dp2": (_layout, 2),
    "dp2 ckpt:selective": (dp2_selective, 2),
    "dp2 ckpt:full": (dp2_full, 2),
    "tp2 sp": (tp2_sp, 2),
    "tp2 sp ckpt:full": (tp2_sp_full, 2),
}
BASELINE = "dp2"
PEERS = {"dp2 ckpt:selective": "dp2", "dp2 ckpt:full": "dp2", "tp2 sp ckpt:full": "tp2 sp"}
REFERENCE = "dp2"
MODEL = BENCH_MODEL
