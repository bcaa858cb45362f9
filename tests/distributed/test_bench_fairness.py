"""The benchmarks compare like with like: every case of every suite builds the same optimizer (torch's fused
AdamW with the same hyper-parameters), on the same threads, dtype and seeds, and a comparison whose cases
differ is refused before anything is timed. Nothing here is timed."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from benchmarks import common, suite
from benchmarks.common import (
    ADAMW,
    Timer,
    UnfairComparison,
    check_same_setup,
    expected_setup,
    paratrain_optimizer,
    record_optimizer,
    record_setup,
    run_case,
    torch_adamw,
)
from paratrain.config import load_config
from paratrain.optim import build_optimizer
from tests.cases import import_deepspeed


def _params():
    return torch.nn.Linear(4, 4).parameters()


def test_paratrain_config_and_torch_peer_build_the_same_fused_adamw():
    peer = record_optimizer(torch_adamw(_params()))
    ours = record_optimizer(build_optimizer(load_config({"optimizer": paratrain_optimizer()}).optimizer, _params()))
    assert ours == peer == expected_setup()["optimizer"]
    assert peer["fused"] is True and peer["class"] == "torch.optim.adamw.AdamW"
    assert (peer["lr"], peer["betas"], peer["eps"], peer["weight_decay"]) == (1e-3, [0.9, 0.95], 1e-8, 0.1)
    # what the old peers had: torch's default AdamW, a loop over the parameters, is a different setup
    assert record_optimizer(torch.optim.AdamW(_params(), **ADAMW))["fused"] is None


def _setup(optimizer) -> dict:
    model = torch.nn.Linear(4, 4)
    model.init_seed = common.SEED
    return record_setup(optimizer(model.parameters()), model, types.SimpleNamespace(seed=common.SEED))


def test_a_comparison_of_different_setups_is_refused_naming_the_case_and_the_field():
    fused, loop = _setup(torch_adamw), _setup(lambda p: torch.optim.AdamW(p, **ADAMW))
    check_same_setup({"paratrain DDP": fused, "torch DDP": dict(fused)})  # equal: accepted
    with pytest.raises(UnfairComparison, match=r"case 'torch DDP' is not set up like 'paratrain DDP': "
                                               r"optimizer\.fused is None, not True"):
        check_same_setup({"paratrain DDP": fused, "torch DDP": loop})
    other = {**fused, "threads": 2, "dtype": "torch.bfloat16", "seed": {"model": 1, "data": 0}}
    with pytest.raises(UnfairComparison) as info:
        check_same_setup({"a": fused, "b": other})
    assert all(f in str(info.value) for f in ("dtype is 'torch.bfloat16', not 'torch.float32'",
                                              "seed.model is 1, not 0", "threads is 2, not 1"))
    with pytest.raises(UnfairComparison, match="case 'b' recorded no setup"):
        check_same_setup({"a": fused, "b": None})


def test_the_timer_refuses_before_the_first_step():
    steps = []
    with pytest.raises(UnfairComparison, match="case 'this case' is not set up like"):
        Timer(0, _setup(lambda p: torch.optim.AdamW(p, **ADAMW))).measure(3, lambda: steps.append(1))
    assert steps == []


# ---- the suite refuses to compare cases whose records differ ---------------------------------------------------
def fair_case(steps: int, warmup: int) -> dict:
    return {"setup": _setup(torch_adamw), "step_times": [0.1], "losses": [1.0], "peak_rss": 1, "state_bytes": 1}


def unfair_case(steps: int, warmup: int) -> dict:
    return {**fair_case(steps, warmup), "setup": _setup(lambda p: torch.optim.AdamW(p, **ADAMW, foreach=True))}


class _OneProcess:
    """suite.run_suite's World, in this process (the fake cases need no process group)."""

    def __init__(self, size: int, timeout_s: float):
        self.size = size

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def run(self, fn, *args):
        return [fn(*args) for _ in range(self.size)]


def test_the_suite_refuses_a_comparison_whose_cases_recorded_different_setups(monkeypatch):
    fake = types.SimpleNamespace(CASES={"ours": (fair_case, 2), "peer": (unfair_case, 2)}, BASELINE="peer")
    monkeypatch.setitem(sys.modules, "benchmarks.fake_suite", fake)
    monkeypatch.setattr(suite, "World", _OneProcess)
    with pytest.raises(UnfairComparison, match=r"case 'peer \(repeat 1, rank 0\)' is not set up like "
                                               r"'ours \(repeat 1, rank 0\)': optimizer\.foreach is True, not None"):
        suite.run_suite("fake_suite", repeats=1, steps=1, warmup=0)
    fake.CASES["peer"] = (fair_case, 2)
    result = suite.run_suite("fake_suite", repeats=1, steps=1, warmup=0)
    assert result["setup"] == {"ours": expected_setup(), "peer": expected_setup()}


# ---- every real case, built and stepped once on a small GPT ------------------------------------------------
# A smaller GPT of the same shape family: every layout still applies (tp 2, pp 2 over 6 layers, cp 2).
SMALL = dict(seq_len=32, d_model=64, n_head=8)


def one_step_setup(suite_name: str, case: str) -> dict:
    """On every rank: run `case` of `suite_name` for one untimed step on the small GPT; its recorded setup."""
    saved = dict(common.BENCH_MODEL)
    common.BENCH_MODEL.update(SMALL)  # in place: the suites hold the same dict
    try:
        fn, _ = importlib.import_module(f"benchmarks.{suite_name}").CASES[case]
        return run_case(case, fn, 1, 0)["setup"]
    finally:
        common.BENCH_MODEL.update(saved)


def _cases(world_size: int) -> list[tuple[str, str]]:
    """Every case of every suite that runs on `world_size` ranks (the p4 pipelines: the p2 code on 4 ranks)."""
    out = []
    for name in suite.SUITES:
        module = importlib.import_module(f"benchmarks.{name}")
        out += [(name, case) for case, (_, size) in module.CASES.items() if size == world_size]
    return out


def setups_in_one_call(cases: list[tuple[str, str]]) -> dict[str, dict]:
    """On every rank: each case's setup, all inside one `World.run`."""
    from benchmarks import moe

    out = {}
    for name, case in cases:
        if name == "moe":  # its own model, as the suite runs it
            out[f"moe: {case}"] = run_case(case, moe.CASES[case], 1, 0)["setup"]
        else:
            out[f"{name}: {case}"] = one_step_setup(name, case)
    return out


def test_every_case_of_every_suite_builds_the_common_setup(world1, world2, monkeypatch):
    import_deepspeed()  # the ZeRO suite's peers
    from benchmarks import moe
    from paratrain.testing import World

    pairs = _cases(2) + [("moe", case) for case in moe.CASES]
    ours = [(name, case) for name, case in pairs if "DeepSpeed" not in case]
    deepspeed = [(name, case) for name, case in pairs if "DeepSpeed" in case]
    setups = world2.run(setups_in_one_call, ours)[0] | world1.run(setups_in_one_call, _cases(1))[0]
    # DeepSpeed keeps its process groups in module globals (created once, then looked up by name), and a
    # world drops the groups made during a call when the call ends: the DeepSpeed cases share one world of
    # their own, all in one call, so the shared worlds never hold DeepSpeed globals naming dropped groups.
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # as benchmarks.suite sets it, before that world is spawned
    with World(2, timeout_s=600) as world:
        setups |= world.run(setups_in_one_call, deepspeed)[0]
    assert len(setups) == len(pairs) + len(_cases(1)) and len(deepspeed) == 6
    assert {"zero: DeepSpeed ZeRO-3", "ddp: torch DDP", "tp: torch TP+SP", "pp: torch interleaved v2 p2",
            "zero: torch FSDP2", "zero: reference (1 process)", "cp: one process", "moe: DeepSpeed-MoE ep_size=2",
            "moe: paratrain ep2", "overhead: DeepSpeed ZeRO-1", "peft: DeepSpeed ZeRO-3 + peft LoRA",
            "peft: torch FSDP2 + peft LoRA", "peft: reference LoRA (1 process)"} <= set(setups)
    check_same_setup({"expected": expected_setup(), **setups})
