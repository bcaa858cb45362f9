"""The big-init benchmark's code runs (on a tiny Llama, paratrain's cases): what it reports is what a rank
holds, and the formula it compares against is the one of `paratrain.zero.estimate_memory`."""

from __future__ import annotations

import json

import pytest

from benchmarks import big_init


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_big_init_runs_and_reports_every_phase(tmp_path):
    out = tmp_path / "big_init.json"
    result = big_init.main(["--model", "llama-tiny", "--weights", str(tmp_path / "w.safetensors"), "--only",
                            "paratrain", "--results", str(out)])
    assert json.loads(out.read_text())["model"] == "llama-tiny"
    for case in ("paratrain ZeRO-3 (dp4)", "paratrain ZeRO-3 (dp4), meta_init sharded", "paratrain ZeRO-1 (dp2 x tp2)"):
        ranks = result["cases"][case]
        assert len(ranks) == 4
        for r in ranks:
            assert r["baseline"] <= r["init"] <= r["load"] <= r["step"]
            assert r["formula_init"] > r["baseline"] and len(r["losses"]) == big_init.STEPS
    zero3 = result["cases"]["paratrain ZeRO-3 (dp4)"][0]
    assert zero3["local_params"] == result["params"]  # ZeRO-3 shards over dp: the rank's Ψ is the model's
    tp2 = result["cases"]["paratrain ZeRO-1 (dp2 x tp2)"][0]
    assert tp2["local_params"] < result["params"]  # tensor parallelism divides Ψ itself
    assert "| paratrain ZeRO-3 (dp4) |" in big_init.table(result)
