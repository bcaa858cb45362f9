"""engine.evaluate against one process: the token-weighted loss over a whole dataset (sum of every target
token's loss / number of target tokens over all rows), in ddp2, ZeRO-1/2/3 over dp2, tp2, a 1F1B pipeline over
2 stages, cp2 (ring and Ulysses) and ep2 (an MoE), on rows of different lengths (right padding) and rows with
masked prompts, with row counts that do not divide into micro_batch x dp (the tail is padded with masked rows),
an iterable whose ranks hold unequal shares, and max_batches. Every rank must return the same number bit for
bit: the trainer's early stopping decides on it on every rank without another exchange."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import paratrain
from paratrain.testing import rel_diff
from tests.cases import adamw_config, tiny_gpt
from tests.real_data import RealRows, documents, logits_of

pytestmark = pytest.mark.multiprocess

MICRO = 2
LAYOUTS = {"ddp2": {}, "zero1 dp2": {"zero_optimization": {"stage": 1}},
           "zero2 dp2": {"zero_optimization": {"stage": 2}}, "zero3 dp2": {"zero_optimization": {"stage": 3}},
           "tp2": {"tensor_parallel": {"size": 2}},
           "pp2 1f1b": {"pipeline": {"stages": 2, "schedule": "1f1b"}, "gradient_accumulation_steps": 2},
           "cp2 ring": {"context_parallel": {"size": 2, "method": "ring"}},
           "cp2 ulysses": {"context_parallel": {"size": 2, "method": "ulysses"}},
           "ep2 moe": {"expert_parallel": {"size": 2}}}


def _model(layout: str):
    """The tiny GPT, or for expert parallelism a dropless tiny Mixtral-style MoE (4 experts, top-2) without router
    losses: the model adds aux_loss_coef · aux + z_loss_coef · z to its loss per micro-batch, and those depend on
    how the rows are batched, so only the language-model loss is one process's number (docs/evaluation.md)."""
    if layout.startswith("ep"):
        from paratrain.models.llama_moe.model import LlamaMoE

        torch.manual_seed(3)
        return LlamaMoE("mixtral-tiny", aux_loss_coef=0.0, z_loss_coef=0.0)
    return tiny_gpt(seed=3)


def _rows() -> dict[str, RealRows]:
    # 13 and 7 rows: neither divides into 2 rows x 2 ranks, nor into a pipeline's rounds of 2 x 2
    return {"right padded 13": RealRows("right", count=13, seed=1), "masked prompts 7": RealRows("masked", count=7)}


def one_process_loss(model, rows) -> float:
    """sum(token losses) / count(target tokens) over every row, each document alone (float64 sums)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(rows)):
            for ids, labels in documents(rows[i]):
                targets = F.pad(labels[1:], (0, 1), value=-100)
                logits = logits_of(model, ids.unsqueeze(0))[0].double()
                total += float(F.cross_entropy(logits, targets, reduction="sum"))
                count += int((targets != -100).sum())
    return total / count


def _evaluate_layouts() -> list[dict]:
    results = []
    for name, layout in LAYOUTS.items():
        reference = _model(name).eval()
        cfg = adamw_config(train_micro_batch_size_per_gpu=MICRO, **layout)
        engine, *_ = paratrain.initialize(model=_model(name), config=cfg)
        dp, dp_rank = engine.mesh.size("dp"), engine.mesh.local_rank("dp")
        for rows_name, rows in _rows().items():
            got = float(engine.evaluate(rows))
            results.append({"case": (name, rows_name), "got": got, "want": one_process_loss(reference, rows),
                            "training": engine.module.training})
        rows = _rows()["right padded 13"]
        # max_batches=1: the first micro-batch of every dp rank, i.e. the first MICRO x dp rows
        first = [rows[i] for i in range(MICRO * dp)]
        results.append({"case": (name, "max_batches 1"), "got": float(engine.evaluate(rows, max_batches=1)),
                        "want": one_process_loss(reference, first), "training": engine.module.training})
        # an iterable of this rank's micro-batches: dp rank 0 holds rows 0-5, rank 1 rows 6-9 (one micro-batch
        # fewer: it runs a masked one while rank 0 runs its third)
        share = [rows[i] for i in (range(6) if dp_rank == 0 or dp == 1 else range(6, 10))]
        every = [rows[i] for i in range(10 if dp > 1 else 6)]
        loader = DataLoader(share, batch_size=MICRO)
        results.append({"case": (name, "unequal iterables"), "got": float(engine.evaluate(loader)),
                        "want": one_process_loss(reference, every), "training": engine.module.training})
    return results


def test_evaluate_is_one_process_token_weighted_loss_in_every_layout(world2):
    per_rank = world2.run(_evaluate_layouts)
    for rank0, rank1 in zip(*per_rank):
        assert rank0["case"] == rank1["case"]
        assert rank0["got"] == rank1["got"], rank0["case"]  # bit-equal on every rank: one stop decision
        assert rel_diff(rank0["got"], rank0["want"]) < 1e-6, (rank0["case"], rank0["got"], rank0["want"])
        assert rank0["training"] and rank1["training"], rank0["case"]  # back in training mode
    assert len(per_rank[0]) == len(LAYOUTS) * 4


def _train_until_stopped(run_dir: str) -> dict:
    from paratrain.trainer import train

    return train({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                  "optimizer": {"type": "AdamW", "params": {"lr": 0.0}}, "pipeline": {"stages": 2},
                  "trainer": {"model": "gpt-tiny", "steps": 10, "eval_every": 1, "eval_batches": 3,
                              "eval_at_start": True, "early_stopping": {"patience": 2}, "run_dir": run_dir,
                              "progress_bar": False,
                              "model_overrides": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16}}})


def test_every_pipeline_stage_stops_at_the_same_step(world2, tmp_path):
    # lr 0: no validation loss improves on step 0's; both stages must stop after step 2 (a stage that trained
    # on alone would wait in its next send for ever)
    summaries = world2.run(_train_until_stopped, str(tmp_path))
    assert [s["stopped_early_at"] for s in summaries] == [2, 2]
    assert summaries[0]["best_val_step"] == 0 and summaries[0]["best_val_loss"] == summaries[1]["best_val_loss"]
