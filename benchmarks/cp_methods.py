"""Ring attention against Ulysses at cp = 2, for sequences of 512 and 2,048 tokens: the same 2 sequences per
step, the same GPT, data and AdamW + clipping.

Each case also times its attention core alone (forward + backward of one layer's core on this rank's
(b, heads, s/cp, head_dim) shard, `extra_attn_ms`): ring attention passes K and V blocks around the cp
ranks; Ulysses all-to-alls q, k, v into head shards of the whole sequence, runs torch's fused causal SDPA,
and all-to-alls the output back.
"""

from __future__ import annotations

from functools import partial

import torch.distributed as dist

from benchmarks.common import LocalBatches, Timer, bench_model, paratrain_optimizer, record_setup
from benchmarks.cp import attention_ms

SEQUENCES_PER_STEP = 2


def paratrain_cp(steps: int, warmup: int, method: str, seq_len: int) -> dict:
    import paratrain

    cfg = {"train_micro_batch_size_per_gpu": SEQUENCES_PER_STEP, "gradient_clipping": 1.0,
           "optimizer": paratrain_optimizer(), "context_parallel": {"size": dist.get_world_size(), "method": method}}
    model = bench_model(seq_len=seq_len)
    engine, *_ = paratrain.initialize(model=model, config=cfg)
    batches = LocalBatches(SEQUENCES_PER_STEP, 1, 0, seq_len=seq_len)
    timer = Timer(warmup, record_setup(engine.optimizer, model, batches))
    timer.measure(steps, lambda: engine.train_batch(batches))
    stats = engine.comm_stats()
    moved = sum(c["bytes"] for ops in stats.values() for c in ops.values())
    return timer.result(state_bytes=engine.memory_stats()["total"],
                        extra_attn_ms=round(attention_ms(engine, SEQUENCES_PER_STEP, seq_len), 2),
                        extra_comm_mib_per_step=round(moved / (steps + warmup) / 2**20, 2))


CASES: dict = {}
PEERS: dict = {}
for _seq in (512, 2048):
    for _method in ("ring", "ulysses"):
        CASES[f"{_method} cp2 seq{_seq}"] = (partial(paratrain_cp, method=_method, seq_len=_seq), 2)
    PEERS[f"ulysses cp2 seq{_seq}"] = f"ring cp2 seq{_seq}"
BASELINE = "ring cp2 seq512"
