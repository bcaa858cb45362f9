"""MoE routing in the metrics: per-step totals of every training forward (moe/stats.py), the step reporter's
events and moe_tokens.jsonl, the trainer's metrics rows and `paratrain report`'s heat map and summary line."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from paratrain.model_spec import spec_for
from paratrain.models.llama_moe.model import LlamaMoE
from paratrain.moe import collect_routing, reduce_routing, take_routing
from paratrain.parallel.recompute import checkpoint_activations

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_collector_sums_a_steps_training_forwards_and_resets():
    torch.manual_seed(0)
    model = LlamaMoE("mixtral-tiny")
    checkpoint_activations(model, "full", blocks=spec_for(model).blocks(model))  # the recompute must not count
    idx = torch.randint(0, 256, (2, 16))
    aux = []
    for _ in range(2):
        model(idx, idx).backward()
        aux.append([layer.mlp.last.aux_loss for layer in model.model.layers])
    model.eval()
    model(idx, idx)  # evaluation: not counted
    step = reduce_routing(take_routing(model))
    assert list(step.layers) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    for i, layer in enumerate(step.layers.values()):
        assert sum(layer.counts) == 2 * idx.numel() * 2 and layer.forwards == 2 and layer.dropped == 0
        assert layer.aux_loss == pytest.approx((aux[0][i] + aux[1][i]) / 2, rel=1e-6)
    assert step.load_max >= 1.0 >= step.load_min and step.dropped_fraction == 0.0
    again = collect_routing(model)  # reset: nothing since the last collection
    assert all(sum(layer.counts) == 0 and layer.forwards == 0 for layer in again.layers.values())
    assert collect_routing(torch.nn.Linear(2, 2)) is None


def test_training_writes_moe_metrics_and_the_report_draws_them(tmp_path):
    from paratrain.report import build_report
    from paratrain.trainer import train

    monitor = {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}
    train({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "csv_monitor": monitor,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
           "trainer": {"model": "mixtral-tiny", "steps": 3, "eval_every": 0, "run_dir": str(tmp_path),
                       "progress_bar": False, "model_overrides": {"capacity_factor": 1.0}}})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    choices = 2 * 2 * 16 * 2  # micro-batch x both accumulated micro-batches x seq_len x top_k
    assert len(rows) == 3
    for row in rows:
        assert list(row["moe_tokens"]) == ["model.layers.0.mlp", "model.layers.1.mlp"]
        assert all(sum(counts) == choices and len(counts) == 4 for counts in row["moe_tokens"].values())
        assert row["moe_dropped_fraction"] == pytest.approx(sum(row["moe_dropped"].values()) / (2 * choices))
    lines = [json.loads(line) for line in (tmp_path / "job" / "moe_tokens.jsonl").read_text().splitlines()]
    assert [line["tokens"] for line in lines] == [row["moe_tokens"] for row in rows]
    with (tmp_path / "job" / "Train_Samples_moe_load_max.csv").open() as handle:
        table = list(csv.reader(handle))
    assert table[0] == ["step", "moe_load_max"] and len(table) == 4
    assert "moe_aux_loss" in (tmp_path / "metrics.csv").read_text().splitlines()[0]

    build_report(tmp_path)
    assert (tmp_path / "moe_tokens.png").read_bytes()[:8] == PNG
    summary = (tmp_path / "summary.md").read_text()
    dropped = sum(sum(row["moe_dropped"].values()) for row in rows) / (3 * 2 * choices)
    assert "- MoE routing (2 layers x 4 experts, 3 steps): most loaded expert " in summary
    assert f"{dropped:.2%} of the routed choices dropped" in summary and "moe_tokens.png" in summary
