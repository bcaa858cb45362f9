"""Our pipeline schedules vs torch.distributed.pipelining on the same GPT, split, data and AdamW + clipping.

Both sides cut the model (embed, 6 blocks, final norm + head) at the same boundaries (balanced parameter
counts), run m = 2p micro-batches of 2 sequences per step (the same m for every schedule at a given p),
clip the global gradient norm to 1.0 (summed over the stages) and report the mean loss on every rank. Our
cases also report the measured bubble of each rank in the last step (idle time within the step span) and
the unit-slot bubble of the same schedule. On a CPU shared by more processes than cores a waiting rank's
core goes to someone else, so the bubble shows only when every rank has a core of its own.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import (
    LocalBatches,
    Timer,
    bench_model,
    paratrain_optimizer,
    peak_rss_bytes,
    record_setup,
    torch_adamw,
)

PP_MODEL = dict(n_layer=6)
TIMELINES_ENV = "PARATRAIN_BENCH_TIMELINES"  # a directory: rank 0 of each case writes its timeline there
MICRO_BATCH = 2


def micro_batches(stages: int) -> int:
    return 2 * stages


def _boundaries(stages: int, placement: str = "loop") -> list[int]:
    from paratrain.models import gpt_pipeline_module
    from paratrain.parallel.pp.split import choose_boundaries

    return choose_boundaries(gpt_pipeline_module(bench_model(**PP_MODEL)), "parameters", stages,
                             placement=placement)[0]


def _per_rank(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def paratrain_pp(steps: int, warmup: int, schedule: str = "1f1b", virtual: int = 1, tp: int = 1) -> dict:
    import paratrain
    from paratrain.parallel.pp.schedules import placement_of
    from paratrain.parallel.pp.timeline import measured_bubbles

    p = dist.get_world_size() // tp
    m = micro_batches(p)
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": m,
           "gradient_clipping": 1.0, "optimizer": paratrain_optimizer(), "tensor_parallel": {"size": tp},
           "pipeline": {"stages": p, "schedule": schedule, "virtual_stages": virtual,
                        "partition": _boundaries(p * virtual, placement_of(schedule))}}
    model = bench_model(**PP_MODEL)
    engine, *_ = paratrain.initialize(model=model, config=cfg)
    batches = LocalBatches(MICRO_BATCH, 1, 0, m)
    timer = Timer(warmup, record_setup(engine.optimizer, model, batches))
    timer.measure(steps, lambda: engine.train_batch(batches))
    timeline = engine.pipeline_timeline()
    bubbles = measured_bubbles(timeline)
    keep = os.environ.get(TIMELINES_ENV)
    if keep and dist.get_rank() == 0:  # the last step's events, for the timeline pictures of the docs
        path = Path(keep) / (f"{schedule}_p{p}" + (f"_tp{tp}" if tp > 1 else "")) / "timeline.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(timeline))
    return timer.result(state_bytes=engine.memory_stats()["total"],
                        extra_bubble=[round(b["bubble"], 3) for b in bubbles],
                        extra_unit_bubble=round(bubbles[0]["unit_bubble"], 3),
                        extra_rss_mib=[round(r / 2**20) for r in _per_rank(peak_rss_bytes())])


def torch_pp(steps: int, warmup: int, schedule: str = "1f1b", virtual: int = 1) -> dict:
    from torch.distributed import pipelining

    from paratrain.models import gpt_pipeline_module

    p, rank = dist.get_world_size(), dist.get_rank()
    m = micro_batches(p)
    model = bench_model(**PP_MODEL)
    pipe = gpt_pipeline_module(model)
    bounds = _boundaries(p * virtual)
    mine = [c * p + rank for c in range(virtual)]
    local = {i for s in mine for i in range(bounds[s], bounds[s + 1])}
    for i, layer in enumerate(pipe.specs):
        if i not in local:
            layer.to("meta")
    group = dist.new_group(list(range(p)))
    stages = [pipelining.PipelineStage(torch.nn.Sequential(*pipe.specs[bounds[s]:bounds[s + 1]]), s, p * virtual,
                                       torch.device("cpu"), group=group) for s in mine]
    kind = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
            "interleaved": pipelining.ScheduleInterleaved1F1B}[schedule]
    runner = kind(stages if virtual > 1 else stages[0], n_microbatches=m, loss_fn=model.loss_fn)
    params = [q for s in stages for q in s.submod.parameters()]
    opt = torch_adamw(params)
    batches = LocalBatches(MICRO_BATCH, 1, 0, m)
    first, last = 0 in mine, p * virtual - 1 in mine

    def step():
        micro = [next(batches) for _ in range(m)]
        x, y = torch.cat([b[0] for b in micro]), torch.cat([b[1] for b in micro])
        losses: list = []
        if first and last:
            runner.step(x, target=y, losses=losses)
        elif first:
            runner.step(x)
        elif last:
            runner.step(target=y, losses=losses)
        else:
            runner.step()
        grads = [q.grad for q in params]
        # foreach kernels, as paratrain's clipping: one norm over every tensor, one scale of every tensor
        sq = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)), 2).pow(2).reshape(1)
        dist.all_reduce(sq, group=group)  # the global norm sums over the stages, as ours does
        coef = 1.0 / (float(sq.sqrt()) + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
        opt.step()
        opt.zero_grad(set_to_none=False)
        loss = torch.stack(losses).mean().reshape(1) if losses else torch.zeros(1)
        dist.all_reduce(loss, group=group)  # every rank reports the loss, as train_batch does
        return loss

    timer = Timer(warmup, record_setup(opt, model, batches))
    timer.measure(steps, step)
    state = sum(q.numel() * q.element_size() for q in params) * 2 + sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim() > 0)
    return timer.result(state_bytes=state, extra_rss_mib=[round(r / 2**20) for r in _per_rank(peak_rss_bytes())])


CASES: dict = {}
PEERS: dict = {}
for _p in (2, 4):
    for _name, _label, _v in [("gpipe", "GPipe", 1), ("1f1b", "1F1B", 1), ("interleaved", "interleaved v2", 2)]:
        CASES[f"paratrain {_label} p{_p}"] = (partial(paratrain_pp, schedule=_name, virtual=_v), _p)
        CASES[f"torch {_label} p{_p}"] = (partial(torch_pp, schedule=_name, virtual=_v), _p)
        PEERS[f"paratrain {_label} p{_p}"] = f"torch {_label} p{_p}"
    CASES[f"paratrain ZB-H1 p{_p}"] = (partial(paratrain_pp, schedule="zb-h1"), _p)
    PEERS[f"paratrain ZB-H1 p{_p}"] = f"paratrain 1F1B p{_p}"  # the same m: what splitting the backward buys
BASELINE = "torch 1F1B p2"
