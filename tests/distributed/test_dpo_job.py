"""The DPO job: `paratrain train` with a dpo objective on data.format "preference", end to end on 2 processes.

LoRA on the built-in Llama (the reference: the adapters off), plain-text pairs from a file, held-out pairs
evaluated every 3 steps (9 of them: the ranks' shares are padded). Every step's row has TRL's metric names, every
evaluation's their eval/ names, in metrics.jsonl, metrics.csv and the csv_monitor's files; killed after step 5, the
job resumes from its step-3 checkpoint and repeats steps 4-6 bit for bit: the same samples, losses and metrics,
although the first run evaluated before step 4 and the resumed one did not (an evaluation leaves the next step's
metrics alone). `paratrain report` then draws the reward accuracy and margin.
"""

from __future__ import annotations

import csv
import json
import random
import shutil

from tests.distributed.test_data_job import SAVED_AT, STEPS, _as_killed_after_step, _rows, _train

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def write_pairs(path, n: int, seed: int) -> None:
    """A word-sorting preference: the chosen completion is the prompt's words sorted, the rejected one reversed."""
    rng = random.Random(seed)
    words = ["ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen", "ibis", "jay"]
    with path.open("w") as handle:
        for _ in range(n):
            picked = rng.sample(words, rng.randint(2, 5))
            order = sorted(picked)
            handle.write(json.dumps({"prompt": "sort: " + " ".join(picked) + " ->", "chosen": " " + " ".join(order),
                                     "rejected": " " + " ".join(order[::-1])}) + "\n")


def dpo_config(train: str, validation: str, run_dir: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 1.0,
            "objective": {"type": "dpo", "beta": 0.1},
            "peft": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]},
            "checkpoint": {"dir": f"{run_dir}/ck", "save_every": SAVED_AT, "auto_resume": True},
            "csv_monitor": {"enabled": True, "output_path": run_dir, "job_name": "csv"},
            "data": {"train": train, "validation": validation, "format": "preference", "seq_len": 40},
            "trainer": {"model": "llama-tiny", "model_overrides": {"vocab_size": 260, "seq_len": 40}, "steps": STEPS,
                        "eval_every": 3, "run_dir": run_dir, "progress_bar": False}}


def test_a_dpo_job_logs_trls_metrics_evaluates_held_out_pairs_and_resumes_bit_for_bit(world2, tmp_path):
    from paratrain.report import build_report

    train, validation = tmp_path / "train.jsonl", tmp_path / "validation.jsonl"
    write_pairs(train, 64, seed=0)
    write_pairs(validation, 9, seed=1)
    base = tmp_path / "run"
    summary = world2.run(_train, dpo_config(str(train), str(validation), str(base)))[0]
    want = _rows(base)
    assert summary["data"]["train"]["examples"] == 64 and summary["data"]["validation"]["examples"] == 9
    assert [r["step"] for r in want] == list(range(1, STEPS + 1))
    for row in want:
        assert all(name in row for name in METRICS), row
        # each pair's margin is its two float32 rewards' difference: equal to the means' difference to float32 rounding
        assert abs(row["rewards/margins"] - (row["rewards/chosen"] - row["rewards/rejected"])) < 1e-7, row
    evaluated = [r for r in want if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [3, 6]
    assert all(0 <= r["eval/rewards/accuracies"] <= 1 and all(f"eval/{n}" in r for n in METRICS) for r in evaluated)
    header = next(csv.reader((base / "metrics.csv").open()))
    assert set(METRICS) | {f"eval/{name}" for name in METRICS} <= set(header), header
    tracked = {path.name for path in (base / "csv").glob("*.csv")}
    assert {"train_rewards_accuracies.csv", "eval_rewards_accuracies.csv", "eval_loss.csv"} <= tracked, tracked

    killed = tmp_path / "killed"
    shutil.copytree(base, killed)
    _as_killed_after_step(killed / "ck", 5)  # the last save at step 3: steps 4-6 again
    config = dpo_config(str(train), str(validation), str(killed))
    again = world2.run(_train, config)[0]
    assert again["resumed_at"] == SAVED_AT
    got = _rows(killed)
    keys = ("step", "loss", "samples", "val_loss", *METRICS, *(f"eval/{name}" for name in METRICS))
    assert [{k: r.get(k) for k in keys} for r in got] == [{k: r.get(k) for k in keys} for r in want]

    build_report(base)
    text = (base / "summary.md").read_text()
    assert "- preference (dpo): training reward accuracy" in text and "held-out pairs: reward accuracy" in text, text
    assert (base / "preference.png").is_file()
