"""Overhead-bound training: a GPT of 48 blocks of width 32 (MLP 128) on sequences of 16 tokens, so little compute that a
step's time is mostly per-parameter and per-module Python work (hooks, bucket bookkeeping, staging copies,
host syncs). The peers at their best, 2 ranks, the same fused AdamW, clipping, data and seed:

    paratrain DDP vs torch DDP; paratrain ZeRO-3 vs FSDP2 (`fully_shard` per block); paratrain ZeRO-1 vs
    DeepSpeed ZeRO-1 (the same 1M-element buckets, overlap_comm and contiguous_gradients).

The ratios are the baseline the architecture's lean hot path must keep or improve
(`python -m benchmarks.suite --only overhead`).
"""

from __future__ import annotations

from functools import partial

from benchmarks.ddp import paratrain_ddp, torch_ddp
from benchmarks.zero import _deepspeed, _paratrain, torch_fsdp2

SHAPE = dict(n_layer=48, d_model=32, n_head=4, d_ff=128, seq_len=16)  # 0.61M parameters in 48 blocks

CASES = {
    "paratrain DDP": (partial(paratrain_ddp, shape=SHAPE), 2),
    "torch DDP": (partial(torch_ddp, shape=SHAPE), 2),
    "paratrain ZeRO-3": (partial(_paratrain, 3, shape=SHAPE), 2),
    "torch FSDP2": (partial(torch_fsdp2, shape=SHAPE), 2),
    # every block's parameters in the root unit (576 small tensors): the per-parameter cost of ZeRO-3's reduce
    "paratrain ZeRO-3, one unit": (partial(_paratrain, 3, shape=SHAPE, wrap_module_names=["head"]), 2),
    "torch FSDP2, one unit": (partial(torch_fsdp2, shape=SHAPE, per_block=False), 2),
    "paratrain ZeRO-1": (partial(_paratrain, 1, shape=SHAPE), 2),
    "DeepSpeed ZeRO-1": (partial(_deepspeed, 1, shape=SHAPE), 2),
}
PEERS = {"paratrain DDP": "torch DDP", "paratrain ZeRO-3": "torch FSDP2",
         "paratrain ZeRO-3, one unit": "torch FSDP2, one unit", "paratrain ZeRO-1": "DeepSpeed ZeRO-1"}
BASELINE = "torch DDP"
REFERENCE = "torch DDP"  # every case trains the same model on the same batches: the same losses
