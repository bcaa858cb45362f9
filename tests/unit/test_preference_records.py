"""data.format "preference": TRL's standard preference rows as token-id pairs (paratrain/data/preference_records.py).

Plain and conversational rows, implicit prompts as TRL's `extract_prompt` finds them (its own docstring's example),
eos after plain completions, the chat template's turns for conversational ones, TRL's keep_start cut to seq_len, and
each bad row an error naming its file and line, the field and the fix.
"""

from __future__ import annotations

import json

import pytest

from paratrain.config import ConfigError, load_config
from paratrain.data.preference_records import Pairs, extract_prompt, tokenize_pair, tokenize_pairs
from paratrain.data.sources import DataError, iter_records
from paratrain.data.tokenizer import ByteTokenizer
from paratrain.errors import InvalidValueError
from tests.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


SKY = [{"role": "user", "content": "What color is the sky?"}]
BLUE, GREEN = [{"role": "assistant", "content": "It is blue."}], [{"role": "assistant", "content": "It is green."}]


def test_extract_prompt_is_trls():
    # trl.data_utils.extract_prompt's docstring example, and its plain-text rule: the space before the point where
    # chosen and rejected part goes to the completions
    assert extract_prompt(SKY + BLUE, SKY + GREEN) == (SKY, BLUE, GREEN)
    assert extract_prompt("The sky is blue.", "The sky is green.") == ("The sky is", " blue.", " green.")


def test_plain_pair_prompt_with_special_tokens_completions_with_eos(tok):
    pair = tokenize_pair({"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Rome."}, tok)
    assert pair.prompt_ids == tok("The capital of France is")["input_ids"]
    assert tok.decode(pair.chosen_ids) == " Paris.<|eos|>" and tok.decode(pair.rejected_ids) == " Rome.<|eos|>"
    implicit = tokenize_pair({"chosen": "The capital of France is Paris.",
                              "rejected": "The capital of France is Rome."}, tok)
    assert implicit == pair
    assert tokenize_pair({"prompt": "ab", "chosen": "c", "rejected": "de"}, ByteTokenizer()).rejected_ids == \
        [100, 101, ByteTokenizer.eos_token_id]


def test_data_fields_rename_the_pair_fields(tok):
    row = {"question": "The capital of France is", "good": " Paris.", "bad": " Rome."}
    fields = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    assert tokenize_pair(row, tok, fields=fields) == \
        tokenize_pair({"prompt": row["question"], "chosen": row["good"], "rejected": row["bad"]}, tok)
    with pytest.raises(InvalidValueError, match=r"data.fields maps \['answer'\], which format 'preference' does not"):
        tokenize_pairs([row], tok, fields={"answer": "good"})


def test_conversational_pair_rendered_by_the_chat_template(tok):
    pair = tokenize_pair({"prompt": SKY, "chosen": BLUE, "rejected": GREEN}, tok)
    assert tok.decode(pair.prompt_ids) == "<|im_start|>user\nWhat color is the sky?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(pair.chosen_ids) == "It is blue.<|im_end|>\n"
    assert tok.decode(pair.rejected_ids) == "It is green.<|im_end|>\n"
    # implicit: the common messages are the prompt; a plain-text prompt beside conversational completions is not
    # used (TRL's maybe_extract_prompt)
    assert tokenize_pair({"chosen": SKY + BLUE, "rejected": SKY + GREEN}, tok) == pair
    assert tokenize_pair({"prompt": "sky?", "chosen": SKY + BLUE, "rejected": SKY + GREEN}, tok) == pair


def test_pairs_cut_to_seq_len_keep_start_and_collated_to_seq_len(tok):
    rows = [{"prompt": "The capital of France is", "chosen": " Paris. " * 6, "rejected": " Rome."},
            {"prompt": "The capital of France is the capital of Italy is the capital of", "chosen": " Spain",
             "rejected": " Rome"}]
    whole = tokenize_pair(rows[0], tok)
    pairs, summary = tokenize_pairs(rows, tok, seq_len=12, on_untrainable="skip")
    assert len(pairs) == 1 and summary.skipped_untrainable == 1  # its prompt fills seq_len: TRL drops it
    (pair,) = pairs
    room = 12 - len(pair.prompt_ids)
    assert pair.chosen_ids == whole.chosen_ids[:room] and pair.rejected_ids == whole.rejected_ids
    assert summary.truncated == 1 and summary.truncated_tokens == len(whole.chosen_ids) - room
    with pytest.raises(DataError, match=r"record:2: the prompt has \d+ tokens, which leave no completion token"):
        tokenize_pairs(rows, tok, seq_len=12)
    data = Pairs(pairs, seq_len=12, pad_id=2)
    batch = data.collate_fn([data[0]])
    assert batch["input_ids"].shape == (2, 12) and batch["completion_mask"][0].sum() == room
    assert batch["input_ids"][0].tolist() == pair.prompt_ids + pair.chosen_ids
    assert data.padding_fraction([0]) == pytest.approx(1 - pair.tokens() / 24)


@pytest.mark.parametrize("row, message", [
    ({"prompt": "a", "rejected": "b"}, r"pairs.jsonl:2: the record has no field 'chosen' .*give every record "
                                       r"'chosen' and 'rejected'.*data.fields"),
    ({"prompt": SKY, "chosen": BLUE, "rejected": [{"role": "narrator", "content": "no"}]},
     r"pairs.jsonl:2: message 1 of 'rejected' has role 'narrator', which the chat templates do not know"),
    ({"prompt": "a", "chosen": "b", "rejected": ""}, r"pairs.jsonl:2: the rejected completion is empty"),
    ({"chosen": "same", "rejected": "same"}, r"pairs.jsonl:2: the chosen completion is empty once the common "
                                             r"beginning of chosen and rejected is taken as the prompt"),
    ({"prompt": SKY, "chosen": SKY + BLUE, "rejected": GREEN}, r"the chosen completion begins with a 'user' message"),
    ({"prompt": "a", "chosen": "b", "rejected": GREEN}, r"'chosen' and 'rejected' must both be text or both lists"),
])
def test_a_bad_row_is_named_with_its_file_and_line(tmp_path, tok, row, message):
    path = tmp_path / "pairs.jsonl"
    good = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=message):
        tokenize_pairs(iter_records(str(path)), tok, seq_len=64)


def _config(data: dict, objective: dict | None = None) -> dict:
    return {"train_batch_size": 2, "objective": objective or {"type": "dpo"},
            "data": {"train": "pairs.jsonl", "format": "preference", **data}}


@pytest.mark.parametrize("data, objective, message", [
    ({"packing": True}, None, r"data.packing = True does not apply to data.format \"preference\""),
    ({"overflow": "split"}, None, r"data.overflow = 'split' does not apply"),
    ({"streaming": True}, None, r"data.streaming = True does not apply"),
    ({}, {"type": "sft"}, r"data.format \"preference\" gives pairs, which the sft objective does not train on"),
    ({"format": "chat"}, None, r"objective.type \"dpo\" trains on preference pairs, but data.format is \"chat\""),
])
def test_the_config_refuses_what_pairs_cannot_do(data, objective, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_config(data, objective))
    load_config(_config({"packing": False, "overflow": "truncate"}))  # the settings pairs take are accepted
