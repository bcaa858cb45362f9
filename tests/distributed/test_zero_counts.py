"""ZeRO's communication and memory, counted: collectives per optimizer step and model-state bytes per rank.

The counting model has odd sizes (d_model 31, d_ff 125, seq 15, vocab 251) so that flat buffers need
padding: every expected count below is the padded one, ceil(n / N) * N elements per flat buffer, computed
here from the module structure, not read from the strategy.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import paratrain
from paratrain.zero import estimate_memory
from tests.cases import adamw_config, corpus_windows, tiny_gpt

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ODD = dict(d_model=31, n_head=1, d_ff=125, seq_len=15, vocab_size=251)


def odd_gpt():
    return tiny_gpt(**ODD)


def _padded(n: int, world: int) -> int:
    return -(-n // world) * world


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


PERSIST = 64  # LayerNorm weights and biases (31 elements) stay gathered


def _engine(stage: int, accumulation: int = 1, precision: str = "fp32", **zero):
    cfg = adamw_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=accumulation,
                       zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0, **zero})
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    engine, _, loader, _ = paratrain.initialize(model=odd_gpt(), config=cfg, training_data=corpus_windows(15))
    return engine, loader


class _CopyOps(TorchDispatchMode):
    """Counts the copies of a step (copy_ and cat: how gradients move into the staging buffers) and the in-place
    scalings (div_, mul_: passes over the gradients)."""

    def __init__(self):
        super().__init__()
        self.counts = {"copy_": 0, "cat": 0, "div_": 0, "mul_": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.counts:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _hooks_entered(engine, loader) -> Counter:
    """One more step, watched from outside: every Python function the autograd engine enters during its
    backwards (tensor hooks, post-accumulate hooks, hooks on a gradient accumulator node, custom Functions'
    backwards, multi-grad hooks), counted per function. A hook of any kind on every parameter shows as a
    function entered once per parameter."""
    entered: Counter = Counter()

    def watch(frame, event, arg):
        if event == "call" and frame.f_back is not None and frame.f_back.f_code.co_name == "_engine_run_backward":
            entered[f"{frame.f_code.co_filename}:{frame.f_code.co_firstlineno}:{frame.f_code.co_name}"] += 1

    sys.setprofile(watch)
    try:
        engine.train_batch(loader)
    finally:
        sys.setprofile(None)
    return entered


def _tensor_hooks(engine) -> int:
    """Hooks the parameters themselves carry: `register_hook` (`_backward_hooks`) and post-accumulate hooks."""
    return sum(len(p._backward_hooks or {}) + len(p._post_accumulate_grad_hooks or {})
               for p in engine.module.parameters())


def _step_counts(engine, loader, copies: dict | None = None) -> dict:
    engine.train_batch(loader)  # warm-up step, then count one step
    engine.comm_stats(reset=True)
    with _CopyOps() as ops:
        engine.train_batch(loader)
    if copies is not None:
        copies.update(ops.counts)
    stats = engine.comm_stats(by_tag=True)
    # the dp axis's collectives, and the norm's one scalar, which goes over the world (here: the same 2 ranks)
    return {(op, tag): c for axis in ("dp", "world") for op, tags in stats.get(axis, {}).items()
            for tag, c in tags.items()}


def _count_cases() -> dict:
    out = {}
    small = {"reduce_bucket_size": 9000}
    cases = (("s1", 1, 1, {}), ("s1_acc2", 1, 2, {}), ("s1_small", 1, 1, small),
             ("s2", 2, 1, {}), ("s2_acc2", 2, 2, {}), ("s2_small", 2, 1, small),
             ("s3", 3, 1, {}), ("s3_acc2", 3, 2, {}), ("s3_no_reshard", 3, 1, {"reshard_after_forward": False}),
             ("s3_root_empty", 3, 1, {"wrap_module_names": ["embed", "blocks.*", "ln_f", "head"]}),
             ("s3_persist", 3, 1, {"stage3_param_persistence_threshold": PERSIST}),
             ("s3_bf16", 3, 1, {"precision": "bf16"}))
    for name, stage, acc, zero in cases:
        engine, loader = _engine(stage, acc, **zero)
        copies: dict = {}
        counts = _step_counts(engine, loader, copies)
        buckets = [b.layout.numel for b in getattr(engine.grad_sync, "buckets", [])]
        memory = engine.memory_stats()
        entered = _hooks_entered(engine, loader) if stage == 3 else Counter()
        out[name] = {"counts": counts, "bucket_numels": buckets, "memory": memory, "copies": copies,
                     "grad_hooks": _tensor_hooks(engine), "most_entered": max(entered.values(), default=0),
                     "params": len(list(engine.module.parameters()))}
    return out


@pytest.mark.parametrize("world", ["world2", "world4"])
def test_collectives_per_step_match_the_zero_formulas(world, request):
    n = int(world[-1])
    result = request.getfixturevalue(world).run(_count_cases)[0]
    model = odd_gpt()
    psi = _numel(model)
    blocks = [_numel(b) for b in model.blocks]
    root = psi - sum(blocks)
    psi_pad = _padded(psi, n)
    units_pad = sum(_padded(b, n) for b in blocks)
    root_pad = _padded(root, n)
    assert psi_pad > psi and units_pad + root_pad > psi  # padding is really exercised

    def check(name, all_gather, reduce_scatter, calls_ag, calls_rs, element_size=4):
        counts = result[name]["counts"]
        assert set(counts) == {("all_gather", "param"), ("reduce_scatter", "grad"), ("all_reduce", "grad_norm"),
                               ("all_reduce", "loss")}, (name, counts)
        assert counts[("all_gather", "param")] == {"calls": calls_ag, "elements": all_gather,
                                                   "bytes": element_size * all_gather}, name
        assert counts[("reduce_scatter", "grad")] == {"calls": calls_rs, "elements": reduce_scatter,
                                                      "bytes": element_size * reduce_scatter}, name
        assert counts[("all_reduce", "grad_norm")]["elements"] == 1

    # ZeRO-1/2: one reduce-scatter of Ψ and one all-gather of Ψ (stage 2 reduces every micro-step).
    check("s1", psi_pad, psi_pad, 1, 1)
    check("s1_acc2", psi_pad, psi_pad, 1, 1)
    check("s2", psi_pad, psi_pad, 1, 1)
    check("s2_acc2", psi_pad, 2 * psi_pad, 1, 2)
    for name in ("s1_small", "s2_small"):
        numels = result[name]["bucket_numels"]
        assert len(numels) > 2 and sum(numels) == psi
        padded = sum(_padded(b, n) for b in numels)
        check(name, padded, padded, len(numels), len(numels))
    # ZeRO-3: every unit gathered for forward and again for backward, the root once (kept for its
    # backward, see fsdp.py); gradients reduce-scattered once per micro-step.
    units = len(blocks)
    check("s3", 2 * units_pad + root_pad, units_pad + root_pad, 2 * units + 1, units + 1)
    check("s3_acc2", 2 * (2 * units_pad + root_pad), 2 * (units_pad + root_pad), 2 * (2 * units + 1),
          2 * (units + 1))
    check("s3_no_reshard", units_pad + root_pad, units_pad + root_pad, units + 1, units + 1)
    # With every parameter in a unit the root owns nothing: exactly 2Ψ gathered, Ψ reduced (1.5x DDP).
    leaves = [_numel(model.embed), *blocks, _numel(model.ln_f), _numel(model.head)]
    all_pad = sum(_padded(x, n) for x in leaves)
    check("s3_root_empty", 2 * all_pad, all_pad, 2 * len(leaves), len(leaves))
    # bf16: the same elements in half the bytes (parameters and gradients travel in bf16).
    check("s3_bf16", 2 * units_pad + root_pad, units_pad + root_pad, 2 * units + 1, units + 1, element_size=2)
    # Persistent (small) parameters: one unit, gathered once per step (after the update), never freed.
    small = lambda m: sum(p.numel() for p in m.parameters() if p.numel() <= PERSIST)  # noqa: E731
    persist_pad = _padded(small(model), n)
    big_blocks = sum(_padded(_numel(b) - small(b), n) for b in model.blocks)
    big_root = _padded(root - (small(model) - sum(small(b) for b in model.blocks)), n)
    check("s3_persist", 2 * big_blocks + big_root + persist_pad, big_blocks + big_root + persist_pad,
          2 * units + 2, units + 2)
    # The reduce has no per-parameter cost: no gradient hook of any kind on any parameter (none on the tensors,
    # and no function the autograd engine enters once per parameter in a backward), and per micro-step each
    # unit's gradients go into its staging buffer with one cat and its shard moves with one copy_ (bf16: two,
    # the cast): 3 of each for the 25-tensor GPT in 3 units.
    leaf_units = len(leaves)
    want_copies = {"s3": (units + 1, units + 1, 1), "s3_acc2": (units + 1, units + 1, 2),
                   "s3_no_reshard": (units + 1, units + 1, 1), "s3_root_empty": (leaf_units, leaf_units, 1),
                   "s3_persist": (units + 2, units + 2, 1), "s3_bf16": (units + 1, 2 * (units + 1), 1)}
    assert result["s3"]["params"] == 25 and units + 1 == 3
    for name, (cats, copy_, micro_steps) in want_copies.items():
        r = result[name]
        assert r["grad_hooks"] == 0, (name, r["grad_hooks"])
        assert 0 < r["most_entered"] < micro_steps * r["params"], (name, r["most_entered"], r["params"])
        assert r["copies"]["cat"] == micro_steps * cats, (name, r["copies"])
        assert r["copies"]["copy_"] == micro_steps * copy_, (name, r["copies"])
    # The average's division is folded into the update's one scaling pass (with the token count and the clip
    # factor): no div_, and one mul_ per flat gradient (a bucket at stages 1-2, a unit's flat buffer at 3)
    flats = {"s1": len(result["s1"]["bucket_numels"]), "s2": len(result["s2"]["bucket_numels"]), "s3": units + 1}
    for name, count in flats.items():
        assert result[name]["copies"]["div_"] == 0 and result[name]["copies"]["mul_"] == count, \
            (name, result[name]["copies"])
    memory = result["s3_persist"]["memory"]
    padded = big_blocks + big_root + persist_pad
    assert memory["total"] == estimate_memory(padded, n, 3, persistent_params=persist_pad)["total"]
    assert memory["gathered_params"] == 4 * persist_pad  # only the persistent unit stays gathered


MEMORY_CASES = [  # (stage, precision, zero extras)
    (0, "fp32", {}), (1, "fp32", {}), (2, "fp32", {}), (3, "fp32", {}),
    (0, "bf16", {}), (1, "bf16", {}), (2, "bf16", {}), (3, "bf16", {}),
    (1, "fp32", {"offload_optimizer": {"device": "cpu"}}), (2, "fp32", {"offload_optimizer": {"device": "cpu"}}),
    (3, "fp32", {"offload_optimizer": {"device": "cpu"}}),
    (3, "bf16", {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
]


def _memory_cases() -> list[dict]:
    out = []
    for stage, precision, zero in MEMORY_CASES:
        engine, loader = _engine(stage, 1, precision, **zero)
        at_init = engine.memory_stats()
        for _ in range(2):
            engine.train_batch(loader)
        sync = engine.grad_sync
        padded = sync.padded_numel() if hasattr(sync, "padded_numel") else _numel(engine.module)
        out.append({"stats": engine.memory_stats(), "at_init": at_init, "padded": padded})
    return out


@pytest.mark.parametrize("world", ["world2", "world4"])
def test_model_state_bytes_match_the_formulas_and_estimate_memory(world, request):
    n = int(world[-1])
    psi = _numel(odd_gpt())
    formula = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}
    for (stage, precision, zero), got in zip(MEMORY_CASES, request.getfixturevalue(world).run(_memory_cases)[0]):
        offload = "none" if not zero else "optimizer+param" if "offload_param" in zero else "optimizer"
        stats = got["stats"]
        want = estimate_memory(got["padded"], n, stage, offload, precision)
        for key in ("params", "grads", "optimizer_state", "total", "host", "device"):
            assert stats[key] == want[key], (stage, precision, zero, key, stats, want)
        # Before the first backward: the same parameters, no optimizer state yet (Adam's is made by its first
        # step), and at stages 2-3 no gradient shard either (the first reduction makes it, as FSDP2 does).
        at_init = got["at_init"]
        assert at_init["params"] == want["params"] and at_init["optimizer_state"] == 0, (stage, zero, at_init)
        assert at_init["grads"] == (0 if stage >= 2 else want["grads"]), (stage, precision, zero, at_init, want)
        if precision == "fp32" and offload == "none":
            assert abs(stats["total"] - formula[stage]) <= 0.05 * formula[stage], (stage, stats, formula[stage])
            # and the raw-Ψ estimate is the formula itself
            assert estimate_memory(psi, n, stage)["total"] == pytest.approx(formula[stage], abs=8 * n)
        if stage == 3:
            assert stats["gathered_params"] == 0  # nothing stays gathered between steps


def _in_flight() -> dict:
    cfg = adamw_config(train_micro_batch_size_per_gpu=2,
                       zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    model = tiny_gpt(n_layer=4)
    before = (type(model.blocks[0]), model.blocks[0], model.blocks[0].attn.q.weight)
    engine, _, loader, _ = paratrain.initialize(model=model, config=cfg, training_data=corpus_windows())
    sync = engine.grad_sync
    after = (type(model.blocks[0]), model.blocks[0], model.blocks[0].attn.q.weight)
    identity = all(a is b for a, b in zip(before, after)) and engine.module is model
    seen = {"forward": [], "backward": []}
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: seen["forward"].append((i, sync.gathered_units())))
        for p in block.parameters():
            p.register_post_accumulate_grad_hook(lambda p, i=i: seen["backward"].append((i, sync.gathered_units())))
    sizes = {u.name: u.allocated_bytes() for u in [sync.root, *sync.units]}
    engine.train_batch(loader)
    after_step = (sync.gathered_units(), engine.memory_stats()["gathered_params"])
    # the gathered full state dict evaluates like the engine
    state = engine.full_state_dict()
    plain = tiny_gpt(n_layer=4)
    plain.load_state_dict(state)
    x, y = next(loader)
    with torch.no_grad():
        ours, theirs = float(engine(x, y)), float(plain(x, y))
    return {"seen": seen, "after_step": after_step, "after_eval": sync.gathered_units(), "sizes": sizes,
            "ours": ours, "theirs": theirs, "identity": identity}


def test_stage3_only_units_in_flight_hold_full_parameters(world2):
    r = world2.run(_in_flight)[0]
    assert r["identity"]  # modules and parameters changed in place, not wrapped
    for i, names in r["seen"]["forward"]:  # the root, this block, and the one prefetched after it
        assert set(names) <= {"<root>", f"blocks.{i}", f"blocks.{i + 1}"}, (i, names)
        assert f"blocks.{i}" in names
    for i, names in r["seen"]["backward"]:  # this block (until its last gradient) and the one before it
        assert set(names) <= {"<root>", f"blocks.{i}", f"blocks.{i - 1}"}, (i, names)
    assert r["after_step"] == ([], 0)
    assert r["after_eval"] == []
    assert all(size == 0 for size in r["sizes"].values())  # sharded from the start
    assert r["ours"] == pytest.approx(r["theirs"], rel=1e-6)
