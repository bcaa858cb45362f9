"""The data-parallel options that trade time, memory and communication (docs/strategies.md), each checked
against the run without it and against its formula:

- `overlap_param_gather` (ZeRO-1/2): nobody reads a parameter before its all-gather completed;
- `reduce_at_boundary` (ZeRO-2/3): 1/GA of the reduce-scatter traffic, the unsharded gradients counted;
- `free_grad_buckets` (stages 0-1): no gradient memory between steps, p·Ψ less, parity kept.
"""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.config import ConfigError, load_config
from paratrain.testing.parity import TOLERANCE, layout_parity
from paratrain.zero import estimate_memory
from tests.cases import adamw_config, corpus_windows, tiny_gpt
from tests.distributed.test_zero_counts import odd_gpt

SMALL_BUCKETS = 2000  # elements: the tiny GPT in ~15 buckets, so a read can wait for some of them only


def _engine(model, stage: int, accumulation: int = 2, precision: str = "fp32", bucket_cap_mb: float = 25.0, **zero):
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=accumulation,
                       zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
                       data_parallel={"bucket_cap_mb": bucket_cap_mb})
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    engine, _, loader, _ = paratrain.initialize(model=model, config=cfg, training_data=corpus_windows(15))
    return engine, loader


# ---- overlap_param_gather: every read path right after a step ---------------------------------------------
def _clone(value):
    if isinstance(value, dict):
        return {k: v.detach().clone() for k, v in value.items()}
    return [v.detach().clone() for v in value]


def _read_paths(directory: str):
    """(name, read) pairs; each runs right after a training step, while every bucket is still gathering."""

    def checkpoint(engine, batch):
        engine.save_checkpoint(directory, tag="right_after_a_step")
        return engine.full_state_dict()

    def load_then_read(engine, batch):
        engine.load_checkpoint(directory, tag="right_after_a_step", load_module_only=True)
        return engine.module.state_dict()

    def forward(engine, batch):
        with torch.no_grad():
            return [engine(*batch)]

    return [("module.state_dict", lambda e, b: e.module.state_dict()),
            ("engine.parameters", lambda e, b: list(e.parameters())),
            ("engine.named_parameters", lambda e, b: dict(e.named_parameters())),
            ("module.parameters", lambda e, b: list(e.module.parameters())),
            ("attribute", lambda e, b: [e.module.head.weight, e.module.blocks[0].attn.q.weight]),
            ("full_state_dict", lambda e, b: e.full_state_dict()),
            ("memory_stats, then the buckets themselves", lambda e, b: e.memory_stats() and e.grad_sync.params_full),
            ("forward", forward),
            ("eval_batch", lambda e, b: [e.eval_batch(iter([b, b]))]),
            ("checkpoint", checkpoint),
            ("load_checkpoint", load_then_read)]


def _reads_after_steps(stage: int, precision: str, overlap: bool, directory: str) -> dict:
    engine, loader = _engine(tiny_gpt(), stage, precision=precision, reduce_bucket_size=SMALL_BUCKETS,
                             overlap_param_gather=overlap)
    gather = engine.grad_sync.gather
    first_block = []  # buckets still gathering when the first block's forward starts
    engine.module.blocks[0].register_forward_pre_hook(lambda m, a: first_block.append(len(gather.pending)))
    batch = next(loader)
    reads, losses, in_flight = {}, [], []
    for name, read in _read_paths(f"{directory}/{stage}{precision}{overlap}"):
        losses.append(float(engine.train_batch(loader)))  # its forwards run right after the previous step
        in_flight.append(len(gather.pending))
        reads[name] = _clone(read(engine, batch))
    return {"reads": reads, "losses": losses, "in_flight": in_flight, "buckets": len(engine.grad_sync.buckets),
            "first_block": first_block}


def _overlap_cases(directory: str) -> list:
    return [(stage, precision, _reads_after_steps(stage, precision, True, directory),
             _reads_after_steps(stage, precision, False, directory))
            for stage, precision in ((1, "fp32"), (2, "fp32"), (1, "bf16"))]


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_no_read_path_sees_a_parameter_before_its_all_gather(world2, tmp_path):
    for rank in world2.run(_overlap_cases, str(tmp_path)):
        for stage, precision, overlapped, waited in rank:
            case = f"stage {stage} {precision}"
            assert overlapped["buckets"] > 10, case
            # every read ran while every bucket was still gathering ...
            assert overlapped["in_flight"] == [overlapped["buckets"]] * len(overlapped["reads"]), case
            assert waited["in_flight"] == [0] * len(waited["reads"]), case
            # ... and read exactly what the run that waits at the end of each step reads (bit for bit)
            assert overlapped["losses"] == waited["losses"], case
            for name, value in overlapped["reads"].items():
                assert _equal(value, waited["reads"][name]), (case, name)
            # the forward waits bucket by bucket: later blocks' buckets still gather while block 0 starts
            assert any(0 < n < overlapped["buckets"] for n in overlapped["first_block"]), case
            assert not any(waited["first_block"]), case


# ---- reduce_at_boundary: traffic and memory, counted -------------------------------------------------------
ACCUMULATION = 4


def _boundary_cases() -> dict:
    out = {}
    for stage in (2, 3):
        for boundary in (False, True):
            engine, loader = _engine(odd_gpt(), stage, ACCUMULATION, reduce_at_boundary=boundary)
            engine.train_batch(loader)
            engine.comm_stats(reset=True)
            engine.train_batch(loader)
            traffic = engine.comm_stats(by_tag=True)["dp"]
            x, y = next(loader)  # one micro-step into the next window
            engine.backward(engine(x, y))
            engine.step()
            mid_window = engine.memory_stats()
            for _ in range(ACCUMULATION - 1):
                x, y = next(loader)
                engine.backward(engine(x, y))
                engine.step()
            out[(stage, boundary)] = {"reduce": traffic["reduce_scatter"]["grad"],
                                      "gather": traffic["all_gather"]["param"], "mid_window": mid_window,
                                      "after_step": engine.memory_stats(),
                                      "padded": engine.grad_sync.padded_numel()}
    return out


def test_reduce_at_boundary_sends_one_reduce_scatter_per_window_and_holds_the_unsharded_gradients(world2):
    result = world2.run(_boundary_cases)[0]
    psi = sum(p.numel() for p in odd_gpt().parameters())
    for stage in (2, 3):
        default, boundary = result[(stage, False)], result[(stage, True)]
        padded = boundary["padded"]
        assert padded >= psi and padded == default["padded"]
        assert default["reduce"] == {"calls": default["reduce"]["calls"], "elements": ACCUMULATION * padded,
                                     "bytes": 4 * ACCUMULATION * padded}, stage
        assert boundary["reduce"] == {"calls": default["reduce"]["calls"] // ACCUMULATION, "elements": padded,
                                      "bytes": 4 * padded}, stage  # 1/GA of the default's
        assert boundary["gather"] == default["gather"], stage  # the parameters move as before
        # during the window: the unsharded fp32 gradients of every bucket/unit, on top of the fp32 shards
        assert boundary["mid_window"]["grads"] - default["mid_window"]["grads"] == 4 * padded, stage
        # after the step nothing unsharded is left: the formula of the stage
        want = estimate_memory(padded, 2, stage)
        for stats in (default["after_step"], boundary["after_step"]):
            assert {k: stats[k] for k in want} == want, stage


def _boundary_parity() -> list[dict]:
    data, references, out = corpus_windows(), {}, []
    for stage in (2, 3):
        cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                           zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0,
                                              "reduce_at_boundary": True})
        out.append(layout_parity(cfg, tiny_gpt, data, 5, references=references))
    return out


def test_reduce_at_boundary_keeps_parity(world2):
    for r in world2.run(_boundary_parity)[0]:
        assert r["loss_err"] <= 1e-5 and r["norm_err"] <= 1e-5 and r["param_err"] <= 1e-5, r


# ---- free_grad_buckets: p·Ψ less between steps, allocated bucket by bucket in backward ----------------------
def _free_bucket_cases() -> list[dict]:
    out = []
    for stage, precision in ((0, "fp32"), (1, "fp32"), (0, "bf16"), (1, "bf16")):
        row = {"stage": stage, "precision": precision}
        for free in (False, True):
            engine, loader = _engine(odd_gpt(), stage, 1, precision, bucket_cap_mb=0.03, free_grad_buckets=free,
                                     reduce_bucket_size=9000)  # several buckets at stage 0 and 1
            for _ in range(2):
                engine.train_batch(loader)
            seen = {}

            def record(key: str, engine=engine, seen=seen) -> None:  # a hook's result must be None
                seen.setdefault(key, engine.memory_stats())

            head = engine.module.head
            head.register_forward_hook(lambda m, a, o: record("forward"))
            head.weight.register_post_accumulate_grad_hook(lambda p: record("first_gradient"))
            grads_between = [p.grad is None for p in engine.module.parameters()]
            engine.train_batch(loader)
            sync = engine.grad_sync
            row[free] = {"stats": engine.memory_stats(), "seen": seen, "grad_none": grads_between,
                         "padded": sync.padded_numel() if hasattr(sync, "padded_numel") else psi_of(engine),
                         "first_bucket": sync.buckets[0].layout.padded}
        out.append(row)
    return out


def psi_of(engine) -> int:
    return sum(p.numel() for p in engine.module.parameters())


def test_freed_gradient_buckets_hold_no_gradient_memory_between_steps(world2):
    for row in world2.run(_free_bucket_cases)[0]:
        stage, precision = row["stage"], row["precision"]
        kept, freed = row[False], row[True]
        p = 4 if precision == "fp32" else 2
        padded = freed["padded"]
        want = estimate_memory(padded, 2, stage, precision=precision, free_grad_buckets=True)
        assert {k: freed["stats"][k] for k in want} == want, row
        assert kept["stats"]["total"] - freed["stats"]["total"] == p * padded, row  # 4Ψ in fp32
        assert all(freed["grad_none"]) and not any(kept["grad_none"]), row
        # at the end of the next forward (where activations peak) no gradient memory exists ...
        assert freed["seen"]["forward"]["grads"] == 0 and kept["seen"]["forward"]["grads"] == p * padded, row
        # ... and backward allocates bucket by bucket: at the first gradient, only the head's bucket
        assert freed["seen"]["first_gradient"]["grads"] == p * freed["first_bucket"] < p * padded, row


def _free_bucket_parity() -> list[dict]:
    data, references, out = corpus_windows(), {}, []
    for stage in (0, 1):
        cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                           zero_optimization={"stage": stage, "free_grad_buckets": True})
        out.append(layout_parity(cfg, tiny_gpt, data, 5, references=references))
    return out


def test_freed_gradient_buckets_keep_parity(world2):
    for r in world2.run(_free_bucket_parity)[0]:
        assert r["loss_err"] <= TOLERANCE["fp32"] and r["norm_err"] <= TOLERANCE["fp32"], r
        assert r["param_err"] <= TOLERANCE["fp32"], r


# ---- each option is refused where it does nothing, by name ------------------------------------------------
@pytest.mark.parametrize("key, stage, valid", [("overlap_param_gather", 3, "1 or 2"),
                                                ("reduce_at_boundary", 1, "2 or 3"),
                                                ("free_grad_buckets", 2, "0 or 1")])
def test_options_name_their_stages(key, stage, valid):
    with pytest.raises(ConfigError, match=f"zero_optimization.{key} applies to stages .* set "
                                          f"zero_optimization.stage to {valid}"):
        load_config({"zero_optimization": {"stage": stage, key: True}})
    load_config({"zero_optimization": {"stage": stage, key: False}})  # saying "off" is never an error
