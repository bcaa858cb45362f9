"""ZeRO-3's gradient staging cost per parameter, timed where it happens: the backward.

A GPT of 96 blocks of width 8 (MLP 16) on sequences of 8 tokens, every block's parameters in the root unit
(`wrap_module_names: ["head"]`): 965 small tensors in one unit and almost no arithmetic, so the backward's
time is mostly autograd's own per-node work plus whatever the strategy adds per parameter. Each step is
timed in two parts, with a barrier before each: `engine.backward(loss)` (autograd, and ZeRO-3's staging of
the gradients into the reduce-scatter buffer and its launch) and the rest (forward, `engine.step()`: waiting
for the reduction, the norm, the update). The staging used to be a Python hook and a `copy_` per parameter;
now it is one `cat` per unit at the unit's post-backward (or autograd's end-of-backward callback for the
root). Compare two commits with

    python -m benchmarks.versus_commit f24938c --only zero3_reduce --repeats 5 --steps 20 --warmup 3

("step_times" of a case here are its backward times; "rest_times" the remainder of each step).
Nothing here asserts a time.
"""

from __future__ import annotations

import time
from functools import partial

import torch.distributed as dist

from benchmarks.common import LocalBatches, Timer, bench_model, paratrain_optimizer, record_setup
from benchmarks.zero import MICRO_BATCH

SHAPE = dict(n_layer=96, d_model=8, n_head=2, d_ff=16, seq_len=8)


def _paratrain_backward(steps: int, warmup: int, shape: dict = SHAPE) -> dict:
    import paratrain

    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": paratrain_optimizer(),
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "wrap_module_names": ["head"]}}
    model = bench_model(**shape)
    engine, *_ = paratrain.initialize(model=model, config=cfg)
    batches = LocalBatches(MICRO_BATCH, dist.get_world_size(), dist.get_rank(), seq_len=shape["seq_len"])
    backward_times: list[float] = []

    def step():
        x, y = next(batches)
        loss = engine(x, y)
        dist.barrier()
        tic = time.perf_counter()
        engine.backward(loss)
        backward_times.append(time.perf_counter() - tic)
        engine.step()
        return loss

    timer = Timer(warmup, record_setup(engine.optimizer, model, batches))
    timer.measure(steps, step)
    backward = backward_times[warmup:]
    rest = [total - b for total, b in zip(timer.times, backward)]
    result = timer.result(tensors=sum(1 for _ in model.parameters()))
    return {**result, "step_times": backward, "rest_times": rest,
            "timed": "engine.backward(loss) only; rest_times: the remainder of each step"}


CASES = {"paratrain ZeRO-3, one unit of 965 tensors, backward": (partial(_paratrain_backward), 2)}
