"""data.format "prompt" and the grpo job's config: TRL's prompt-only rows, text or conversational, as one left-padded
batch with their extra columns (paratrain/data/prompt_records.py), and what the config refuses by name."""

from __future__ import annotations

import json

import pytest

from paratrain.config import ConfigError, load_config
from paratrain.data.prompt_records import read_prompts
from paratrain.data.sources import DataError, iter_records
from paratrain.data.tokenizer import ByteTokenizer
from paratrain.trainer.objective_metrics import check_objective_job
from tests.tiny_tokenizer import build_tiny_tokenizer


def _write(tmp_path, rows) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_text_prompts_left_padded_with_their_columns(tmp_path):
    path = _write(tmp_path, [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10+2=", "answer": "12", "hint": "x"}])
    prompts = read_prompts(iter_records(path), ByteTokenizer(), "prompt", longest=8, pad_id=258)
    assert prompts.ids.tolist() == [[258, *b"1+2="], list(b"10+2=")]
    assert prompts.mask.tolist() == [[0, 1, 1, 1, 1], [1] * 5]
    assert prompts.prompts == ["1+2=", "10+2="] and not prompts.conversational
    assert prompts.columns == {"answer": ["3", "12"], "hint": [None, "x"]}
    ids, mask, texts, columns = prompts.take([1])
    assert ids.tolist() == [list(b"10+2=")] and texts == ["10+2="] and columns == {"answer": ["12"], "hint": ["x"]}


def test_conversational_prompts_rendered_with_the_generation_prompt(tmp_path):
    tok = build_tiny_tokenizer()
    question = [{"role": "user", "content": "What is 1+2?"}]
    path = _write(tmp_path, [{"prompt": question}])
    prompts = read_prompts(iter_records(path), tok, "prompt", longest=200, pad_id=tok.pad_token_id)
    rendered = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert prompts.conversational and prompts.prompts == [question]
    assert prompts.ids[0].tolist() == tok(rendered, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("rows, message", [
    ([{"question": "1+2="}], r"prompts.jsonl line 1: a \"prompt\" record needs the field 'prompt'"),
    ([{"prompt": "1+2="}, {"prompt": "1234567890="}], r"prompts.jsonl line 2: the prompt is 11 tokens; a rollout's "
                                                      r"prompt takes 1 to 8 .*objective.max_completion_length"),
    ([{"prompt": "1+2="}, {"prompt": [{"role": "user", "content": "hi"}]}], r"mixes text prompts and conversational"),
])
def test_a_bad_prompt_is_named_with_its_file_and_line(tmp_path, rows, message):
    with pytest.raises(DataError, match=message):
        read_prompts(iter_records(_write(tmp_path, rows)), ByteTokenizer(), "prompt", longest=8, pad_id=0)


def _config(objective: dict | None = None, data: dict | None = None, trainer: dict | None = None, **extra) -> dict:
    return {"train_batch_size": 8, "objective": {"type": "grpo", **(objective or {})},
            "data": {"train": "prompts.jsonl", "format": "prompt", **(data or {})},
            "trainer": {"reward_funcs": ["rewards.py:correct"], **(trainer or {})}, **extra}


@pytest.mark.parametrize("config, message", [
    (_config(data={"packing": True}), r"data.packing = True does not apply to data.format \"prompt\""),
    (_config(data={"format": "text"}), r"set objective.type to \"grpo\" and data.format to \"prompt\" together"),
    ({"train_batch_size": 8, "data": {"train": "p.jsonl", "format": "prompt"}}, r"together \(got sft on \"prompt\""),
    ({"train_batch_size": 8, "objective": {"num_generations": 4}}, r"objective.num_generations sets how a grpo job "
                                                                    r"samples .* objective.type is \"sft\""),
    (_config(objective={"scale_rewards": "std"}), r"scale_rewards"),
])
def test_the_config_refuses_what_a_grpo_job_cannot_do(config, message):
    with pytest.raises(ConfigError, match=message):
        load_config(config)


@pytest.mark.parametrize("config, message", [
    (_config(trainer={"reward_funcs": []}), r"set trainer.reward_funcs"),
    (_config(data={"validation": "v.jsonl"}), r"data.validation: a grpo job does not evaluate held-out data yet"),
    (_config(objective={"num_iterations": 2}, trainer={"steps": 5}), r"trainer.steps = 5 is not a multiple of "
                                                                     r"objective.num_iterations = 2"),
    (_config(objective={"num_iterations": 2}, checkpoint={"dir": "ck", "save_every": 3}), r"checkpoint.save_every = 3"),
])
def test_the_job_refuses_a_grpo_run_it_cannot_make(config, message):
    with pytest.raises(ConfigError, match=message):
        check_objective_job(load_config(config))


def test_the_grpo_example_configs_and_rewards():
    from pathlib import Path

    from paratrain.rl import load_reward_function

    example = Path(__file__).resolve().parents[2] / "examples" / "grpo"
    job = load_config(str(example / "job.json"))
    check_objective_job(job)
    assert job.objective.num_generations == 4 and job.data.format == "prompt"
    assert load_config(str(example / "sft.json")).data.format == "prompt_completion"
    one_digit = load_reward_function(f"{example}/rewards.py:one_digit")
    correct = load_reward_function(f"{example}/rewards.py:correct")
    completions = ["7", "7 ", "x", "12"]
    assert one_digit(["3+4="] * 4, completions, [[]] * 4) == [0.5, 0.0, 0.0, 0.0]
    assert correct(["3+4="] * 4, completions, [[]] * 4, answer=["7", "7", "7", "1"]) == [1.0, 1.0, 0.0, 1.0]
