"""The big-init benchmark's code runs (on a tiny Llama, paratrain's cases): what it reports is what a rank
holds, and the formula it compares against is the one of `paratrain.zero.estimate_memory`."""

from __future__ import annotations

import copy
import json

import pytest

from benchmarks import big_init
from benchmarks.common import UnfairComparison
from tests.cases import import_deepspeed


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_big_init_runs_and_reports_every_phase(tmp_path):
    out = tmp_path / "big_init.json"
    import_deepspeed()
    # every paratrain case, and the peers at their defaults (DeepSpeed's sub_group_size case differs by one key)
    result = big_init.main(["--model", "llama-tiny", "--weights", str(tmp_path / "w.safetensors"), "--only",
                            "paratrain,defaults,FSDP2", "--results", str(out), "--repeats", "1"])
    assert json.loads(out.read_text())["model"] == "llama-tiny"
    from paratrain.zero import estimate_memory

    largest = max(t.numel() for t in big_init._model("llama-tiny").parameters())
    for case, stage, dp in (("paratrain ZeRO-3 (dp4)", 3, 4), ("paratrain ZeRO-3 (dp4), meta_init sharded", 3, 4),
                            ("paratrain ZeRO-1 (dp2 x tp2)", 1, 2)):
        (ranks,) = result["cases"][case]  # one repeat
        assert len(ranks) == 4
        for r in ranks:
            assert r["baseline"] <= r["init"] <= r["load"] <= r["step"]
            assert len(r["losses"]) == big_init.STEPS and all(x == x for x in r["losses"])
            assert r["setup"]["zero_optimization"]["stage"] == stage  # the config the case ran is recorded
            # the formula is the library's: the rank's parameters (and, up to stage 1, gradients) + one whole
            # largest tensor, over the process's RSS before the model existed
            state = estimate_memory(r["local_params"], dp=dp, stage=stage)
            held = state["params"] + (state["grads"] if stage <= 1 else 0)
            assert r["formula_init"] == r["baseline"] + held + 4 * largest, case
            assert r["formula_step"] == r["baseline"] + state["params"] + state["grads"] + \
                state["optimizer_state"] + 4 * largest, case
    zero3 = result["cases"]["paratrain ZeRO-3 (dp4)"][0][0]
    assert zero3["local_params"] == result["params"]  # ZeRO-3 shards over dp: the rank's Ψ is the model's
    tp2 = result["cases"]["paratrain ZeRO-1 (dp2 x tp2)"][0][0]
    assert tp2["local_params"] < result["params"]  # tensor parallelism divides Ψ itself
    body = big_init.table(result)
    assert "| paratrain ZeRO-3 (dp4) |" in body and "| 1 of 1 |" in body
    assert all(len(runs) == 1 and isinstance(runs[0], list) for runs in result["cases"].values()), body
    # main() refused nothing: every case and rank built the same optimizer, threads, dtype, seeds, clipping;
    # a case that differs in one flag is refused, naming it
    cases = copy.deepcopy(result["cases"])
    cases["torch FSDP2 (meta init)"][0][1]["fair"]["optimizer"]["fused"] = None
    with pytest.raises(UnfairComparison, match=r"torch FSDP2 \(meta init\) \(repeat 1, rank 1\).*fused is None"):
        big_init.check_fair(cases)
