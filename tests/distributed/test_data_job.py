"""The fine-tuning job's data (`data` section): rows that hold every token once, packed training equal to
unpacked training, and a data position that survives a kill and any reshard with the same global batch."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from paratrain.data.formats import Example
from paratrain.data.rows import Rows
from paratrain.testing.compare import max_rel_diff
from tests.cases import STABLE_EPS

pytestmark = pytest.mark.multiprocess  # the job's tests start worlds; the rows' tests are instant


def _examples(n: int, seed: int = 0, longest: int = 24) -> list[Example]:
    """Documents whose ids name (document, position) uniquely, half their tokens masked like a prompt."""
    rng = random.Random(seed)
    out = []
    for doc in range(n):
        length = rng.randint(2, longest)
        ids = [doc * 100 + t for t in range(length)]
        prompt = rng.randint(0, length - 1)
        out.append(Example(ids, [-100] * prompt + ids[prompt:], f"docs:{doc}"))
    return out


@pytest.mark.parametrize("packing", [True, False])
def test_rows_hold_every_token_of_every_document_exactly_once(packing):
    examples = _examples(40)
    rows = Rows(examples, seq_len=32, packing=packing, pad_id=9999)
    seen_ids, seen_labels = [], []
    for i in range(len(rows)):
        row = rows[i]
        real = row["attention_mask"].bool()
        assert all(v.shape == (32,) for v in row.values())
        assert (row["labels"][~real] == -100).all() and (row["input_ids"][~real] == 9999).all()
        seen_ids += row["input_ids"][real].tolist()
        seen_labels += row["labels"][real].tolist()
        # positions restart at each document: a token's position is its place in its own document
        assert (row["position_ids"][real] == row["input_ids"][real] % 100).all()
    assert sorted(seen_ids) == sorted(t for e in examples for t in e.input_ids)
    assert sorted(seen_labels) == sorted(t for e in examples for t in e.labels)
    assert sum(rows.real_tokens) == len(seen_ids)
    assert len(rows) == (len(examples) if not packing else len(rows.rows)) and (not packing or len(rows) < 40)
    assert rows.padding_fraction(range(len(rows))) == pytest.approx(1 - len(seen_ids) / (32 * len(rows)))


def _train_rows(packing: bool, steps: int) -> dict:
    """One process: every document in one global batch, packed or one per padded row; losses and weights."""
    import paratrain
    from paratrain.models import Llama

    examples = [Example([t % 250 for t in e.input_ids], [t % 250 if t != -100 else -100 for t in e.labels],
                        e.source) for e in _examples(12, seed=3)]
    rows = Rows(examples, seq_len=32, packing=packing, pad_id=0)
    torch.manual_seed(0)
    model = Llama("llama-tiny", seq_len=32)
    config = {"train_batch_size": len(rows), "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": STABLE_EPS}},
              "gradient_clipping": 0.5}
    engine, _, loader, _ = paratrain.initialize(model=model, config=config, training_data=rows)
    losses = [float(engine.train_batch(loader)) for _ in range(steps)]
    return {"losses": losses, "rows": len(rows), "state": engine.full_state_dict()}


def test_packed_training_equals_training_each_document_in_its_own_padded_row(world1):
    packed, padded = world1.run(_train_rows, True, 3)[0], world1.run(_train_rows, False, 3)[0]
    assert packed["rows"] < padded["rows"] == 12
    assert packed["losses"] == pytest.approx(padded["losses"], rel=1e-5)
    worst, where = max_rel_diff(packed["state"], padded["state"])  # the parity tests' measure: per tensor
    assert worst <= 1e-5, (worst, where)


# ---- the job: kill and resume, reshard --------------------------------------------------------------------
STEPS, SAVED_AT = 6, 3


def write_records(path, n: int = 120) -> None:
    """prompt/completion records of different lengths (bytes: the job's model has no tokenizer)."""
    rng = random.Random(7)
    words = ["the", "a", "model", "of", "data", "rank", "step", "token", "row", "pipeline", "shard", "loss",
             "batch", "layer"]
    with path.open("w") as handle:
        for _ in range(n):
            prompt = " ".join(rng.choices(words, k=rng.randint(1, 6)))
            completion = " ".join(rng.choices(words, k=rng.randint(1, 9)))
            handle.write(json.dumps({"prompt": prompt + "?", "completion": " " + completion}) + "\n")


def job_config(data: str, run_dir: str, ck: str, micro: int, accumulation: int, tp: int = 1, pp: int = 1,
               cp: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "gradient_clipping": 1.0,
            "tensor_parallel": {"size": tp}, "pipeline": {"stages": pp}, "context_parallel": {"size": cp},
            "checkpoint": {"dir": ck, "save_every": SAVED_AT, "auto_resume": True},
            "data": {"train": data, "validation": data, "format": "prompt_completion", "seq_len": 48},
            "trainer": {"model": "llama-tiny", "model_overrides": {"vocab_size": 260, "seq_len": 48},
                        "steps": STEPS, "eval_every": 3, "eval_batches": 1, "run_dir": run_dir, "progress_bar": False}}


def _train(config: dict) -> dict:
    from paratrain.trainer import train

    return train(config)


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _as_killed_after_step(ck, step: int) -> None:
    """The checkpoint directory as a job killed after step `step` would leave it: the last save at or
    before it, nothing later."""
    for path in ck.glob("global_step*"):
        if int(path.name.removeprefix("global_step")) > step:
            shutil.rmtree(path)
    (ck / "latest").write_text(f"global_step{step // SAVED_AT * SAVED_AT}\n")


def test_the_data_position_survives_a_kill_and_any_reshard(world2, world4, tmp_path):
    data = tmp_path / "train.jsonl"
    write_records(data)
    base = tmp_path / "dp2"
    summary = world2.run(_train, job_config(str(data), str(base), str(base / "ck"), micro=2, accumulation=2))[0]
    want = _rows(base)
    assert [r["step"] for r in want] == list(range(1, STEPS + 1)) and summary["data"]["train"]["records"] == 120
    consumed = [s for r in want for s in r["samples"]]
    assert len(consumed) == len(set(consumed)) == 8 * STEPS  # no sample twice inside the epoch
    assert all(0 <= r["padding_fraction"] < 1 and r["loader_wait_s"] >= 0 for r in want)

    # killed after step 5 (the last save at step 3): auto-resume repeats steps 4-6 bit for bit
    killed = tmp_path / "killed"
    shutil.copytree(base, killed)
    _as_killed_after_step(killed / "ck", 5)
    again = world2.run(_train, job_config(str(data), str(killed), str(killed / "ck"), micro=2, accumulation=2))[0]
    assert again["resumed_at"] == SAVED_AT
    got = _rows(killed)
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert [r["samples"] for r in got] == [r["samples"] for r in want]

    # the step-3 checkpoint resumed at dp4 (micro 1), dp2 x tp2 and pp2 x cp2 (dp1, micro 4): the same samples,
    # the same losses
    for name, micro, axes in (("dp4", 1, {}), ("dp2tp2", 2, {"tp": 2}), ("pp2cp2", 4, {"pp": 2, "cp": 2})):
        run = tmp_path / name
        shutil.copytree(base, run)
        _as_killed_after_step(run / "ck", SAVED_AT)
        world4.run(_train, job_config(str(data), str(run), str(run / "ck"), micro=micro, accumulation=2, **axes))
        got = _rows(run)
        assert [r["samples"] for r in got] == [r["samples"] for r in want], name
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5), name
        validated = [(r["step"], r["val_loss"]) for r in want if "val_loss" in r]
        assert [r["step"] for r in got if "val_loss" in r] == [step for step, _ in validated] == [3, 6]
        assert [r["val_loss"] for r in got if "val_loss" in r] == pytest.approx([v for _, v in validated], rel=1e-5)


def _unshuffled_and_small_validation(data: str, small: str, run_dir: str) -> dict:
    from paratrain.config import ConfigError
    from paratrain.trainer import train

    config = job_config(data, run_dir, run_dir + "/ck", micro=2, accumulation=1)
    config["data"] |= {"shuffle": False}
    config["trainer"] |= {"steps": 2, "eval_every": 0}
    config["checkpoint"] = {}
    train(config)
    order = [r["samples"] for r in _rows(Path(run_dir))]
    config["data"] |= {"validation": small}
    config["trainer"] |= {"eval_every": 1}
    try:
        train(config)
        refused = None
    except ConfigError as exc:
        refused = str(exc)
    return {"order": order, "refused": refused}


def test_unshuffled_rows_come_in_file_order_and_a_too_small_validation_set_is_refused_before_training(world1,
                                                                                                       tmp_path):
    write_records(tmp_path / "train.jsonl")
    (tmp_path / "small.jsonl").write_text(json.dumps({"prompt": "a?", "completion": " b"}) + "\n")
    got = world1.run(_unshuffled_and_small_validation, str(tmp_path / "train.jsonl"), str(tmp_path / "small.jsonl"),
                     str(tmp_path / "run"))[0]
    assert got["order"] == [[0, 1], [2, 3]]
    assert "data.validation gives 1 rows of 48 tokens, fewer than one validation micro-batch" in got["refused"]


def test_a_streamed_job_tokenized_by_workers_resumes_on_another_layout_at_the_same_rows(world2, world4, tmp_path):
    data = tmp_path / "train.jsonl"
    write_records(data)
    base = tmp_path / "dp2"
    streamed = {"streaming": True, "stream_window": 16, "workers": 1}  # 8 windows; each rank spawns a worker
    config = job_config(str(data), str(base), str(base / "ck"), micro=2, accumulation=2)
    config["data"] |= streamed
    summary = world2.run(_train, config)[0]
    want = _rows(base)
    consumed = [s for r in want for s in r["samples"]]
    assert len(consumed) == len(set(consumed)) == 8 * STEPS and summary["data"]["streaming"]
    assert summary["data"]["train"]["records"] >= 16  # the windows tokenized so far (ahead of the step too)
    run = tmp_path / "dp4"
    shutil.copytree(base, run)
    _as_killed_after_step(run / "ck", SAVED_AT)
    config = job_config(str(data), str(run), str(run / "ck"), micro=1, accumulation=2)
    config["data"] |= streamed
    world4.run(_train, config)
    got = _rows(run)
    assert [r["samples"] for r in got] == [r["samples"] for r in want]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
