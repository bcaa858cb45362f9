"""Our ZeRO-1/2/3 vs torch FSDP2 (`fully_shard` per block) and DeepSpeed ZeRO-1/2/3, 2 ranks, CPU/gloo.

Every case trains the same GPT from the same seed on the same batches with the same optimizer: torch's
AdamW (fused, lr 1e-3, betas (0.9, 0.95), weight decay 0.1 — passed explicitly, since DeepSpeed's AdamW
defaults to weight decay 0 and torch's to 0.01) and global-norm clipping at 1.0, fp32. DeepSpeed builds it
from its own config section (`"torch_adam": true, "fused": true`; its FusedAdam needs a compiled op) and runs
on its CPU accelerator (DS_ACCELERATOR=cpu, set by the suite) over the gloo group already initialized. Every
sharded case uses stage3_param_persistence_threshold = 0 (shard everything, as FSDP2 does), so the
memory columns compare the same sharding. "reference" is one process on the whole global batch (16): its
losses are what every other case must reproduce; its time is not comparable.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from benchmarks.common import (
    LocalBatches,
    Timer,
    bench_model,
    deepspeed_optimizer,
    paratrain_optimizer,
    record_setup,
    torch_adamw,
)

MICRO_BATCH = 8


def _mean_loss(loss: torch.Tensor) -> torch.Tensor:
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # the same metric cost as train_batch's global mean loss
    return mean / dist.get_world_size()


def _tensor_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensors: this rank's shard
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


# ZeRO-1/2 buckets of 1M elements (the 3.3M-parameter model in 4): with DeepSpeed's default of 5e8 the whole model
# is one bucket, and the post-step all-gather has no next bucket's forward to hide behind. DeepSpeed gets the same
# buckets and its overlap switches on (overlap_comm, contiguous_gradients: its documented advice), so every
# peer runs at its best; the JSON records each case's options. Stage 3 gathers per unit and ignores these.
BUCKET = {"reduce_bucket_size": 1_000_000, "allgather_bucket_size": 1_000_000}
DEEPSPEED_BEST = {**BUCKET, "overlap_comm": True, "contiguous_gradients": True}


def _paratrain(stage: int, steps: int, warmup: int, shape: dict | None = None, **options) -> dict:
    import paratrain

    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 1.0,
           "optimizer": paratrain_optimizer(),
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 **(BUCKET if stage in (1, 2) else {}), **options}}
    model = bench_model(**(shape or {}))
    engine, *_ = paratrain.initialize(model=model, config=cfg)
    batches = LocalBatches(MICRO_BATCH, dist.get_world_size(), dist.get_rank(), seq_len=(shape or {}).get("seq_len"))
    timer = Timer(warmup, record_setup(engine.optimizer, model, batches))
    timer.measure(steps, lambda: engine.train_batch(batches))
    return timer.result(state_bytes=engine.memory_stats()["total"], options=cfg["zero_optimization"])


def paratrain_zero1(steps: int, warmup: int) -> dict:
    return _paratrain(1, steps, warmup)


def paratrain_zero2(steps: int, warmup: int) -> dict:
    return _paratrain(2, steps, warmup)


def paratrain_zero3(steps: int, warmup: int) -> dict:
    return _paratrain(3, steps, warmup)


# The overlap and memory options side by side with the defaults (issue 14): the post-step all-gather at the end
# of the step instead of behind the next forward, and stage 1's gradient buckets freed between steps.
def paratrain_zero1_gather_at_step_end(steps: int, warmup: int) -> dict:
    return _paratrain(1, steps, warmup, overlap_param_gather=False)


def paratrain_zero2_gather_at_step_end(steps: int, warmup: int) -> dict:
    return _paratrain(2, steps, warmup, overlap_param_gather=False)


def paratrain_zero1_free_grad_buckets(steps: int, warmup: int) -> dict:
    return _paratrain(1, steps, warmup, free_grad_buckets=True)


def torch_fsdp2(steps: int, warmup: int, reshard_after_forward: bool = True, shape: dict | None = None,
                per_block: bool = True) -> dict:
    """`per_block=False`: only the head is a unit of its own, every block's parameters are the root's (the
    peer of paratrain's `wrap_module_names: ["head"]`: many small parameters in one unit)."""
    from torch.distributed.fsdp import fully_shard

    model = bench_model(**(shape or {}))
    for block in model.blocks if per_block else [model.head]:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    opt = torch_adamw(model.parameters())
    batches = LocalBatches(MICRO_BATCH, dist.get_world_size(), dist.get_rank(), seq_len=(shape or {}).get("seq_len"))

    def step():
        x, y = next(batches)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return _mean_loss(loss)

    timer = Timer(warmup, record_setup(opt, model, batches))
    timer.measure(steps, step)
    state = _tensor_bytes([*model.parameters(), *(p.grad for p in model.parameters())] +
                          [v for s in opt.state.values() for v in s.values()])
    return timer.result(state_bytes=state, options={"reshard_after_forward": reshard_after_forward})


def torch_fsdp2_keep_gathered(steps: int, warmup: int) -> dict:
    """FSDP2 holding the gathered parameters from forward to backward: its ZeRO-2-like mode, the peer of
    ZeRO-1/2 (parameters gathered once per step, gradients reduce-scattered)."""
    return torch_fsdp2(steps, warmup, reshard_after_forward=False)


def _deepspeed(stage: int, steps: int, warmup: int, shape: dict | None = None) -> dict:
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = bench_model(**(shape or {}))
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 1.0,
              "optimizer": deepspeed_optimizer(), "steps_per_print": 10**9,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                    **(DEEPSPEED_BEST if stage in (1, 2) else {"overlap_comm": True})}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                      dist_init_required=False)
    batches = LocalBatches(MICRO_BATCH, dist.get_world_size(), dist.get_rank(), seq_len=(shape or {}).get("seq_len"))

    def step():
        x, y = next(batches)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return _mean_loss(loss)

    timer = Timer(warmup, record_setup(engine.optimizer, model, batches))
    timer.measure(steps, step)
    return timer.result(state_bytes=_deepspeed_state_bytes(engine), options=config["zero_optimization"])


def _deepspeed_state_bytes(engine) -> int:
    """Every tensor the ZeRO optimizer and the model hold between steps (flat buffers, partitions,
    optimizer state, gradients), each storage once."""
    zero = engine.optimizer
    tensors = []
    for value in vars(zero).values():
        items = value if isinstance(value, (list, tuple)) else value.values() if isinstance(value, dict) else [value]
        for item in items:
            if isinstance(item, torch.Tensor):
                tensors += [item, item.grad]
            elif isinstance(item, (list, tuple)):
                tensors += [t for t in item if isinstance(t, torch.Tensor)]
    for p in engine.module.parameters():
        tensors += [getattr(p, "ds_tensor", p), p.grad]
    tensors += [v for s in zero.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return _tensor_bytes(tensors)


def deepspeed_zero1(steps: int, warmup: int) -> dict:
    return _deepspeed(1, steps, warmup)


def deepspeed_zero2(steps: int, warmup: int) -> dict:
    return _deepspeed(2, steps, warmup)


def deepspeed_zero3(steps: int, warmup: int) -> dict:
    return _deepspeed(3, steps, warmup)


def reference(steps: int, warmup: int) -> dict:
    model = bench_model()
    opt = torch_adamw(model.parameters())
    batches = LocalBatches(2 * MICRO_BATCH, 1, 0)  # the global batch of the 2-rank cases

    def step():
        x, y = next(batches)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    timer = Timer(warmup, record_setup(opt, model, batches))
    timer.measure(steps, step)
    return timer.result(state_bytes=_tensor_bytes([*model.parameters(), *(p.grad for p in model.parameters())] +
                                                  [v for s in opt.state.values() for v in s.values()]))


CASES = {
    "paratrain ZeRO-1": (paratrain_zero1, 2),
    "paratrain ZeRO-2": (paratrain_zero2, 2),
    "paratrain ZeRO-3": (paratrain_zero3, 2),
    "paratrain ZeRO-1, gather at step end": (paratrain_zero1_gather_at_step_end, 2),
    "paratrain ZeRO-2, gather at step end": (paratrain_zero2_gather_at_step_end, 2),
    "paratrain ZeRO-1, free grad buckets": (paratrain_zero1_free_grad_buckets, 2),
    "torch FSDP2": (torch_fsdp2, 2),
    "torch FSDP2, reshard_after_forward=False": (torch_fsdp2_keep_gathered, 2),
    "DeepSpeed ZeRO-1": (deepspeed_zero1, 2),
    "DeepSpeed ZeRO-2": (deepspeed_zero2, 2),
    "DeepSpeed ZeRO-3": (deepspeed_zero3, 2),
    "reference (1 process)": (reference, 1),
}
BASELINE = "torch FSDP2"
# Each of our stages against its peers, ratio of median step times (the targets: <= 1.00 vs FSDP2,
# <= 0.85 vs DeepSpeed at the same stage).
PEERS = {
    "paratrain ZeRO-1": ["DeepSpeed ZeRO-1", "torch FSDP2, reshard_after_forward=False",
                         "paratrain ZeRO-1, gather at step end", "paratrain ZeRO-1, free grad buckets"],
    "paratrain ZeRO-2": ["DeepSpeed ZeRO-2", "torch FSDP2, reshard_after_forward=False",
                         "paratrain ZeRO-2, gather at step end"],
    "paratrain ZeRO-3": ["torch FSDP2", "DeepSpeed ZeRO-3"],
}
REFERENCE = "reference (1 process)"
