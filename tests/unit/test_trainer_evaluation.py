"""Evaluation during `paratrain train` (one process): early stopping ends a run whose validation loss stops
improving and leaves one that improves alone, eval_at_start writes a step-0 row, every training row has an ETA,
`paratrain report` shows both; and the config errors name the fields."""

from __future__ import annotations

import csv
import json

import pytest

from paratrain.config import ConfigError, load_config
from paratrain.trainer.early_stop import ValidationTracker

TINY = {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 16, "vocab_size": 256}


def _config(run_dir, lr: float, steps: int, **trainer) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": lr}},
            "trainer": {"model": "gpt-tiny", "model_overrides": TINY, "steps": steps, "eval_every": 1,
                        "eval_batches": 2, "run_dir": str(run_dir), "progress_bar": False, **trainer}}


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_early_stopping_stops_a_run_whose_validation_loss_stops_improving(tmp_path):
    from paratrain.trainer import train

    # lr 0: the weights never move, every validation loss equals the first, none improves on it
    summary = train(_config(tmp_path, lr=0.0, steps=20, early_stopping={"patience": 2}))
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]  # the best at step 1, then 2 evaluations without improvement
    assert len({r["val_loss"] for r in rows}) == 1
    assert summary["stopped_early_at"] == 3 and summary["steps"] == 3
    assert summary["best_val_step"] == 1 and summary["best_val_loss"] == rows[0]["val_loss"]
    assert json.loads((tmp_path / "summary.json").read_text())["stopped_early_at"] == 3
    assert rows[-1]["eta_s"] > 0  # the ETA counts to the configured last step: the stop was not foreseen


def test_a_run_whose_validation_loss_improves_does_not_stop(tmp_path):
    from paratrain.trainer import train

    summary = train(_config(tmp_path, lr=1e-2, steps=5, early_stopping={"patience": 1}))
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    losses = [r["val_loss"] for r in rows]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses  # patience 1: any miss would have stopped it
    assert summary["stopped_early_at"] is None and summary["steps"] == 5 and summary["best_val_step"] == 5
    assert rows[-1]["eta_s"] == 0.0 and all(r["eta_s"] >= 0 for r in rows)


def test_eval_at_start_writes_a_step_zero_row_and_the_report_shows_it(tmp_path):
    from paratrain.report import build_report
    from paratrain.trainer import train

    summary = train(_config(tmp_path, lr=0.0, steps=3, eval_every=2, eval_at_start=True,
                            early_stopping={"patience": 1}))
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the baseline; step 2's equal loss ends the patience
    assert set(rows[0]) == {"step", "val_loss"} and rows[0]["val_loss"] == rows[2]["val_loss"]
    assert "val_loss" not in rows[1]  # eval_every 2
    assert summary["stopped_early_at"] == 2 and summary["best_val_step"] == 0
    with (tmp_path / "metrics.csv").open() as handle:
        table = list(csv.DictReader(handle))
    assert [row["step"] for row in table] == ["0", "1", "2"] and table[0]["loss"] == ""
    assert float(table[0]["val_loss"]) == rows[0]["val_loss"] and "eta_s" in table[1]
    build_report(tmp_path)
    text = (tmp_path / "summary.md").read_text()
    assert f"- validation loss {rows[0]['val_loss']:.4f} at step 0 (before training)" in text
    assert f"- stopped early at step 2: the validation loss stopped improving (best {rows[0]['val_loss']:.4f} " \
           f"at step 0)" in text
    assert "- layout " in text and ", 2 steps" in text  # the step-0 row is not a training step


def test_min_delta_counts_only_improvements_larger_than_it():
    tracker = ValidationTracker(load_config({"trainer": {"early_stopping": {"patience": 2, "min_delta": 0.1}}})
                                .trainer.early_stopping)
    assert not tracker.observe(1, 3.0)
    assert not tracker.observe(2, 2.95)  # better, but by less than min_delta
    assert tracker.observe(3, 2.91) and tracker.stopped_at == 3 and tracker.best_step == 1
    never = ValidationTracker(None)
    assert not any(never.observe(step, 1.0) for step in range(1, 10)) and never.best_step == 1


@pytest.mark.parametrize("trainer, names", [
    ({"early_stopping": {"patience": 2}, "eval_every": 0}, ["trainer.early_stopping", "trainer.eval_every"]),
    ({"early_stopping": {"patience": 0}}, ["trainer.early_stopping.patience"]),
    ({"early_stopping": {"patients": 2}}, ["trainer.early_stopping.patience"]),
])
def test_early_stopping_config_errors_name_the_fields(trainer, names):
    with pytest.raises(ConfigError) as error:
        load_config({"trainer": trainer})
    assert all(name in str(error.value) for name in names), str(error.value)


def test_eval_batches_zero_evaluates_every_validation_row(tmp_path):
    import torch

    from paratrain.data import TokenWindows
    from paratrain.models import GPT
    from paratrain.trainer import train
    from paratrain.trainer.inputs import split_validation

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog; " * 60)  # 2700 bytes: 16 validation windows
    train({**_config(tmp_path, lr=0.0, steps=1, eval_batches=0, eval_at_start=True, text=str(text)), "seed": 5})
    rows = _rows(tmp_path)
    torch.manual_seed(5)  # the job seeds its model with the config's seed
    model = GPT("gpt-tiny", **TINY).eval()
    _, val_ids = split_validation(torch.frombuffer(bytearray(text.read_bytes()), dtype=torch.uint8).long())
    windows = TokenWindows(val_ids, TINY["seq_len"])
    with torch.no_grad():  # every window has seq_len targets: the token mean is the mean of the windows' means
        want = sum(float(model(*[t.unsqueeze(0) for t in windows[i]])) for i in range(len(windows))) / len(windows)
    assert len(windows) > 2 * 2  # more than eval_batches 2 (of 2 rows) would take: the count matters
    assert rows[0]["step"] == 0 and rows[0]["val_loss"] == pytest.approx(want, rel=1e-6)


def test_samples_are_generated_at_each_evaluation_and_the_report_shows_them(tmp_path):
    from paratrain.report import build_report
    from paratrain.trainer import train

    prompts = ["The ", {"text": "Once upon a"}]
    train(_config(tmp_path, lr=3e-2, steps=4, eval_every=4, eval_at_start=True,
                  samples={"prompts": prompts, "max_new_tokens": 6}))
    rows = [r for r in _rows(tmp_path) if "generations" in r]
    assert [r["step"] for r in rows] == [0, 4]  # at step 0 (eval_at_start) and at each evaluation
    for row in rows:
        assert [g["prompt"] for g in row["generations"]] == ["The ", "Once upon a"]
        # byte tokens, no end-of-sequence id in a 256-token vocabulary: every answer is 6 tokens (bytes)
        assert all(len(g["completion"].encode("utf-8", errors="surrogateescape")) <= 6 * 4 and g["completion"]
                   for g in row["generations"])
    before, after = ([g["completion"] for g in r["generations"]] for r in rows)
    assert before != after  # four steps at lr 3e-2 change what the model says
    build_report(tmp_path)
    text = (tmp_path / "summary.md").read_text()
    assert "- sample generations (greedy) at step 0 and step 4:" in text
    assert json.dumps(after[1]) in text and json.dumps(before[1]) in text


def test_sample_prompts_take_the_data_format_and_name_what_is_missing():
    from paratrain.data.prompts import prompt_ids
    from paratrain.data.sources import DataError
    from paratrain.data.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    assert prompt_ids("ab", "text", tokenizer) == ("ab", [97, 98])
    assert prompt_ids({"question": "hi"}, "prompt_completion", tokenizer, {"prompt": "question"}) == ("hi", [104, 105])
    with pytest.raises(DataError, match="needs the field 'prompt'"):
        prompt_ids({"text": "hi"}, "prompt_completion", tokenizer)
    with pytest.raises(DataError, match="chat template"):  # bytes have no chat template
        prompt_ids("hi", "chat", tokenizer)
