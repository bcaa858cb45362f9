"""The online GRPO job: `paratrain train` with objective.type "grpo" on data.format "prompt", end to end.

The same seeded job (the built-in Llama, byte prompts of small sums with an `answer` column, two reward functions
from a file with weights, num_iterations 2 so each rollout batch is two optimizer steps) in dp2, ZeRO-3, tp2,
tp2 + SP, pp2 and dp2·tp2: every step's rewards, losses and gradient norms within 1e-5 and every completion
token for token (completions.jsonl). Killed after step 3, the dp2 job resumes from its step-2 checkpoint and
samples and trains steps 3-4 bit for bit. `paratrain report` draws the rewards and shows the last step's rollouts.
Bad input stops every rank with the field named: a num_generations that does not divide a rank's completions, a
prompt longer than the model leaves room for.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.cases import STABLE_EPS
from tests.distributed.test_data_job import _rows, _train

pytestmark = pytest.mark.multiprocess

STEPS, SAVED_AT = 4, 2
LAYOUTS = {"zero3": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
           "tp2": {"tensor_parallel": {"size": 2}},
           "tp2sp": {"tensor_parallel": {"size": 2, "sequence_parallel": True}},  # 5 + 4 positions: padded to 10
           "pp2": {"pipeline": {"stages": 2, "schedule": "1f1b"}}}
REWARDS = '''
def even(prompts, completions, completion_ids, **columns):
    return [sum(t % 2 == 0 for t in ids) / 4 for ids in completion_ids]


def correct(prompts, completions, completion_ids, answer, **columns):
    assert all(p.endswith("=") for p in prompts)
    return [1.0 if text.startswith(a) else None if not text else 0.0 for text, a in zip(completions, answer)]
'''


def write_job(tmp_path) -> tuple[str, str]:
    prompts, rewards = tmp_path / "prompts.jsonl", tmp_path / "rewards.py"
    with prompts.open("w") as handle:
        for a in range(4):
            for b in (1 + a, 10 + a, 3, 11):  # prompts of 4 and 5 bytes: left-padded to 5
                handle.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    rewards.write_text(REWARDS)
    return str(prompts), str(rewards)


def grpo_config(prompts: str, rewards: str, run_dir: str, **extra) -> dict:
    return {"seed": 3, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "eps": STABLE_EPS}}, "gradient_clipping": 1.0,
            "objective": {"type": "grpo", "num_generations": 2, "max_completion_length": 4, "temperature": 0.9,
                          "epsilon": 0.1, "num_iterations": 2},
            "checkpoint": {"dir": f"{run_dir}/ck", "save_every": SAVED_AT, "auto_resume": True},
            "data": {"train": prompts, "format": "prompt", "seq_len": 12},
            "trainer": {"model": "llama-tiny", "model_overrides": {"vocab_size": 260, "seq_len": 12}, "steps": STEPS,
                        "run_dir": run_dir, "progress_bar": False,
                        "reward_funcs": [f"{rewards}:even", f"{rewards}:correct"], "reward_weights": [0.5, 1.0]},
            **extra}


def _completions(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]


def _close(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return abs(a - b) <= 1e-5 * max(abs(b), 1e-2)  # the first update's loss is ~0: advantages' mean is zero


def _same_run(got, want, per_rollout: int = 2) -> None:
    rows, base = _rows(got), _rows(want)
    assert [r["step"] for r in rows] == [r["step"] for r in base] == list(range(per_rollout, STEPS + 1, per_rollout))
    for row, expected in zip(rows, base):
        assert row["samples"] == expected["samples"], (row["step"], row["samples"], expected["samples"])
        for key in ("losses", "grad_norms", "reward", "rewards/even/mean"):
            assert _close(row[key], expected[key]), (got.name, row["step"], key, row[key], expected[key])
    assert [(c["prompt"], c["generation"], c["completion_ids"]) for c in _completions(got)] == \
        [(c["prompt"], c["generation"], c["completion_ids"]) for c in _completions(want)]


def _timeless(row: dict) -> dict:
    """A metrics row less what the clock and the process measure (checkpoint/*: the saves this process made)."""
    return {k: v for k, v in row.items() if not k.endswith("_s") and not k.startswith("checkpoint/")
            and k not in ("tokens_per_s", "comm", "comm_bytes", "peak_rss_per_rank")}


def _refused(config: dict) -> str:
    from paratrain.trainer import train

    try:
        train(config)
    except Exception as exc:  # every rank raises before any step
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_grpo_job_is_the_same_run_in_every_layout_and_after_a_kill(world2, world4, tmp_path):
    prompts, rewards = write_job(tmp_path)
    base = tmp_path / "dp2"
    summary = world2.run(_train, grpo_config(prompts, rewards, str(base)))[0]
    assert summary["prompts"] == 16 and summary["steps"] == STEPS and summary["layout"].startswith("dp2")
    rows = _rows(base)
    names = ("reward", "reward_std", "rewards/even/mean", "rewards/correct/mean", "completions/mean_length",
             "completions/clipped_ratio", "clip_ratio/region_mean", "logprob_mismatch", "generation_s", "update_s")
    assert all(name in row for row in rows for name in names), rows[0].keys()
    assert all(row["logprob_mismatch"] <= 1e-6 and len(row["losses"]) == 2 for row in rows)
    records = _completions(base)
    assert len(records) == 2 * 4 * 2 and {r["step"] for r in records} == {2, 4}
    assert all(r["text"] == bytes(i for i in r["completion_ids"] if i < 256).decode("utf-8", "replace")
               for r in records if all(i < 256 for i in r["completion_ids"]))

    from paratrain.report import build_report

    build_report(base)  # what `paratrain report` writes: the reward curve, and the last step's rollouts
    report = (base / "summary.md").read_text()
    assert (base / "rewards.png").is_file() and "- rewards (grpo): reward " in report, report
    assert "- a rollout batch's time (median): generation " in report and set(summary["time_split_s"]) == {
        "generation_s", "rewards_s", "update_s"}
    assert f"- rollouts at step {STEPS} " in report and json.dumps(rows[-1]["rollouts"][0]["completion"]) in report

    for name, layout in LAYOUTS.items():
        world2.run(_train, grpo_config(prompts, rewards, str(tmp_path / name), **layout))
        _same_run(tmp_path / name, base)
    world4.run(_train, grpo_config(prompts, rewards, str(tmp_path / "dp2tp2"), tensor_parallel={"size": 2}))
    _same_run(tmp_path / "dp2tp2", base)

    killed = tmp_path / "killed"
    shutil.copytree(base, killed)
    shutil.rmtree(killed / "ck" / f"global_step{STEPS}")
    (killed / "ck" / "latest").write_text(f"global_step{SAVED_AT}\n")
    again = world2.run(_train, grpo_config(prompts, rewards, str(killed)))[0]
    assert again["resumed_at"] == SAVED_AT
    assert [_timeless(r) for r in _rows(killed)] == [_timeless(r) for r in rows]
    assert _completions(killed) == records

    bad = grpo_config(prompts, rewards, str(tmp_path / "bad"), train_batch_size=6, train_micro_batch_size_per_gpu=3)
    bad["objective"]["num_generations"] = 4  # 3 completions per rank: not whole groups of 4
    assert all("objective.num_generations = 4" in m for m in world2.run(_refused, bad)), world2.run(_refused, bad)
    long = grpo_config(prompts, rewards, str(tmp_path / "long"))
    long["objective"]["max_completion_length"] = 8  # 12 positions - 8 leave 4 for prompts of 5 bytes
    messages = world2.run(_refused, long)
    assert all("prompts.jsonl line 2" in m and "objective.max_completion_length" in m for m in messages), messages


def test_a_rollout_batch_of_two_steps_is_the_same_run_in_every_layout(world2, tmp_path):
    """generation_batch_size 16 = 2 x train_batch_size: one rollout batch of 8 prompts x 2 generations, trained as
    two optimizer steps in order, twice (num_iterations 2): the same run in dp2 (a rank's half of each step's
    prompts), tp2 and pp2 (all of them on one replica), and with LoRA (beta 0.04: the adapters off as the reference)
    in dp2 and tp2; sizes that cut a rollout batch are refused by name."""
    prompts, rewards = write_job(tmp_path)
    rollout = {"generation_batch_size": 16}

    def config(name: str, **layout) -> dict:
        cfg = grpo_config(prompts, rewards, str(tmp_path / name), **layout)
        cfg["objective"].update(rollout)
        cfg["checkpoint"]["save_every"] = STEPS
        return cfg

    world2.run(_train, config("dp2"))
    rows = _rows(tmp_path / "dp2")
    assert len(rows) == 1 and len(rows[0]["losses"]) == 4 and len(rows[0]["samples"]) == 8, rows
    assert len(_completions(tmp_path / "dp2")) == 16
    for name, layout in (("tp2", LAYOUTS["tp2"]), ("pp2", LAYOUTS["pp2"])):
        world2.run(_train, config(name, **layout))
        _same_run(tmp_path / name, tmp_path / "dp2", per_rollout=4)
    # LoRA, its reference the adapters off (beta > 0): the same in dp2 and tp2, and not the full fine-tuning's run
    lora = {"peft": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]}}
    for name, layout in (("lora_dp2", {}), ("lora_tp2", LAYOUTS["tp2"])):
        cfg = config(name, **layout, **lora)
        cfg["objective"]["beta"] = 0.04
        summary = world2.run(_train, cfg)[0]
        assert summary["trainable_params"] < summary["frozen_params"], summary  # the adapters alone train
    _same_run(tmp_path / "lora_tp2", tmp_path / "lora_dp2", per_rollout=4)
    adapted = _rows(tmp_path / "lora_dp2")[0]
    assert adapted["kl"] > 0 and adapted["grad_norms"] != rows[0]["grad_norms"], adapted

    cut = config("cut")
    cut["objective"]["generation_batch_size"] = 12
    assert all("objective.generation_batch_size = 12" in m for m in world2.run(_refused, cut))
    saves = config("saves")
    saves["checkpoint"]["save_every"] = 2
    assert all("checkpoint.save_every = 2" in m and "4 optimizer steps" in m for m in world2.run(_refused, saves))
    both = config("both")
    both["objective"]["steps_per_generation"] = 4
    assert all("objective.generation_batch_size and objective.steps_per_generation" in m
               for m in world2.run(_refused, both))
