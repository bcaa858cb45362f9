"""Muon in every layout against one process running torch's Muon + AdamW on the same groups (fp32, clipping
active): each world runs its whole list of layouts in one call."""

from __future__ import annotations

import pytest

from paratrain.testing.parity import layout_parity
from tests.cases import corpus_windows, tiny_gpt

pytestmark = pytest.mark.multiprocess

STEPS = 4
GLOBAL_BATCH = 8
MUON = {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.05, "ns_dtype": "float32", "adamw": {"lr": 3e-3, "betas": [0.9, 0.95],
                                                                              "eps": 1e-6}}}


def muon_config(dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, sp: bool = False, micro_batch: int = 2,
                **zero_extra) -> dict:
    return {"optimizer": MUON, "gradient_clipping": 0.5, "seed": 7,
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": GLOBAL_BATCH // (micro_batch * dp),
            "tensor_parallel": {"size": tp, "sequence_parallel": sp},
            "pipeline": {"stages": pp, "partition": "uniform"},
            "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0, **zero_extra}}


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["loss_err"] <= 1e-5 and r["norm_err"] <= 1e-5 and r["param_err"] <= 1e-5, r
        assert r["losses"][-1] < r["losses"][0], r


def _matrix(configs: list[dict]) -> list[dict]:
    data, references = corpus_windows(), {}
    return [layout_parity(cfg, tiny_gpt, data, STEPS, references=references) for cfg in configs]


WORLD2 = [muon_config(dp=2), muon_config(dp=2, zero=1), muon_config(dp=2, zero=2), muon_config(dp=2, zero=3),
          muon_config(dp=2, zero=3, offload_optimizer={"device": "cpu"})]


def test_muon_parity_data_parallel(world2):
    for results in world2.run(_matrix, WORLD2):
        _check(results)
