"""A fine-tuning job's data (one process): every file reader, every format's token ids and labels against the
tokenizer and against the text expected by hand, and every error naming the file, the record and the fix."""

from __future__ import annotations

import json

import pytest

from paratrain.data import json_records, sources
from paratrain.data.formats import DataSummary, UntrainableRecordError, tokenize_record, tokenize_records
from paratrain.data.micro_batch import IGNORE
from paratrain.data.packing import pack
from paratrain.data.sources import DataError, iter_records
from paratrain.data.tokenizer import ByteTokenizer, load_tokenizer
from paratrain.errors import InvalidValueError
from tests.cases import import_or_skip

ROWS = [{"text": "one", "n": 12345}, {"text": "two", "n": 6}, {"text": "three", "n": 7}]
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome."}]
CHAT_TEXT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
             "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
             "<|im_start|>assistant\nThe capital of France is Paris.<|im_end|>\n"
             "<|im_start|>user\nAnd of Italy?<|im_end|>\n"
             "<|im_start|>assistant\nRome.<|im_end|>\n")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny BPE tokenizer with its ChatML-like template, saved and loaded back as a job would."""
    import_or_skip("transformers")
    from tests.tiny_tokenizer import save_tiny_tokenizer

    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    save_tiny_tokenizer(directory)
    return load_tokenizer(directory)


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def records(path, **kwargs) -> list[tuple[int, dict]]:
    return [(number, record) for _, number, record in iter_records(path, **kwargs)]


def trained_text(tokenizer, example) -> str:
    return tokenizer.decode([t for t, label in zip(example.input_ids, example.labels) if label != IGNORE])


# ---- readers


def test_jsonl_is_read_line_by_line_numbered_by_line_and_blank_lines_skipped(tmp_path):
    path = write(tmp_path / "d.jsonl", "\n".join(json.dumps(r) for r in ROWS[:2]).replace("\n", "\n\n  \n") + "\n")
    assert records(path) == [(1, ROWS[0]), (4, ROWS[1])]


@pytest.mark.parametrize("chunk", [5, 1 << 20])  # 5: records, numbers and names cross the buffer's end
def test_json_list_and_object_with_one_list_field(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(json_records, "_CHUNK_CHARS", chunk)
    listed = write(tmp_path / "list.json", json.dumps(ROWS, indent=2))
    wrapped = write(tmp_path / "object.json", json.dumps({"version": 1.25, "data": ROWS, "note": "x"}))
    expected = list(enumerate(ROWS, 1))
    assert records(listed) == expected and records(wrapped) == expected


def test_parquet_is_read_by_batches(tmp_path):
    pa = import_or_skip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"text": f"row {i}", "n": i} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=2)
    assert records(tmp_path / "d.parquet") == list(enumerate(rows, 1))


def test_text_by_document_paragraph_and_line(tmp_path):
    path = write(tmp_path / "d.txt", "Para one,\nline two.\n\n\nPara two.\n")
    assert records(path) == [(1, {"text": "Para one,\nline two.\n\n\nPara two."})]
    assert records(path, text_sample_by="paragraph") == [(1, {"text": "Para one,\nline two."}),
                                                         (5, {"text": "Para two."})]
    assert records(path, text_sample_by="line") == [(1, {"text": "Para one,"}), (2, {"text": "line two."}),
                                                    (5, {"text": "Para two."})]
    with pytest.raises(InvalidValueError, match="document, paragraph, line"):
        records(path, text_sample_by="sentence")


def test_directory_recursively_sorted_and_glob(tmp_path):
    write(tmp_path / "b.jsonl", json.dumps(ROWS[1]))
    write(tmp_path / "a" / "z.json", json.dumps([ROWS[0]]))
    write(tmp_path / "c.txt", "three")
    write(tmp_path / "notes.md", "not data")
    write(tmp_path / ".cache" / "x.jsonl", json.dumps(ROWS[2]))  # hidden: skipped
    files = [file for file, _, _ in iter_records(tmp_path)]
    assert files == [str(tmp_path / "a" / "z.json"), str(tmp_path / "b.jsonl"), str(tmp_path / "c.txt")]
    assert [r for _, _, r in iter_records(tmp_path)] == [ROWS[0], ROWS[1], {"text": "three"}]
    assert [r for _, _, r in iter_records(str(tmp_path / "**" / "*.json*"))] == [ROWS[0], ROWS[1]]


def test_dataset_saved_to_disk_alone_and_inside_a_directory(tmp_path):
    datasets = import_or_skip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "data" / "saved"))
    assert sources.is_saved_dataset(tmp_path / "data" / "saved")
    assert records(tmp_path / "data" / "saved") == list(enumerate(ROWS, 1))
    assert [r for _, _, r in iter_records(tmp_path / "data")] == ROWS  # one unit, not its .json files
    assert [r for _, _, r in iter_records(str(tmp_path / "data" / "**"))] == ROWS  # each source once
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"DatasetDict saved with save_to_disk \(splits: train\): give the directory"):
        records(tmp_path / "dict")


# ---- reader errors


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = write(tmp_path / "bad.jsonl", '{"text": "ok"}\n{"text": "cut\n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 2: not valid JSON \(Unterminated string"):
        records(path)
    write(path, '{"text": "ok"}\n["a list"]\n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 2 is a JSON list, not an object"):
        records(path)
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 2 is not UTF-8"):
        records(path)


def test_malformed_json_names_line_and_the_shape_it_needs(tmp_path):
    with pytest.raises(DataError, match=r"bad\.json line 3: Expecting"):
        records(write(tmp_path / "bad.json", '[\n{"text": "a"},\n{"text": }\n]'))
    with pytest.raises(DataError, match="more than one list field \\(train, test\\)"):
        records(write(tmp_path / "two.json", json.dumps({"train": ROWS, "test": ROWS})))
    with pytest.raises(DataError, match="no list field of records \\(fields: version\\)"):
        records(write(tmp_path / "none.json", '{"version": 1}'))
    with pytest.raises(DataError, match="a list of record objects or an object with one list field"):
        records(write(tmp_path / "scalar.json", '"text"'))


@pytest.mark.parametrize("name, text", [("e.jsonl", "\n \n"), ("e.json", "[ ]"), ("e.txt", "  \n"),
                                        ("e.parquet", None)])
def test_an_empty_file_is_an_error_naming_it(tmp_path, name, text):
    if text is None:
        pa = import_or_skip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / name)
    else:
        write(tmp_path / name, text)
    with pytest.raises(DataError, match=f"{name} is empty: it holds no records"):
        records(tmp_path / name)


def test_a_path_that_matches_nothing_is_an_error(tmp_path):
    with pytest.raises(DataError, match="no file matches .*nothing\\*\\.jsonl"):
        records(tmp_path / "nothing*.jsonl")
    with pytest.raises(DataError, match="missing.jsonl does not exist"):
        records(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="not .csv; convert it"):
        records(write(tmp_path / "d.csv", "text\nrow\n"))
    with pytest.raises(DataError, match="holds no .jsonl, .json, .parquet, .txt file"):
        records(write(tmp_path / "docs" / "readme.md", "x").parent)


# ---- formats


def test_text_trains_every_token_and_ends_with_eos(tiny):
    example = tokenize_record({"text": "The capital of Italy is Rome."}, "text", tiny)
    assert example.input_ids == tiny("The capital of Italy is Rome.")["input_ids"] + [tiny.eos_token_id]
    assert example.labels == example.input_ids  # unshifted: the loss shifts them
    assert tiny.decode(example.input_ids) == "The capital of Italy is Rome.<|eos|>"


def test_prompt_completion_trains_the_completion_and_eos_only(tiny):
    example = tokenize_record({"question": "What is the capital of Spain?", "answer": " Madrid."},
                              "prompt_completion", tiny, fields={"prompt": "question", "completion": "answer"})
    prompt = tiny("What is the capital of Spain?")["input_ids"]
    completion = tiny(" Madrid.", add_special_tokens=False)["input_ids"]
    assert example.input_ids == prompt + completion + [tiny.eos_token_id]
    assert example.labels == [IGNORE] * len(prompt) + completion + [tiny.eos_token_id]
    assert trained_text(tiny, example) == " Madrid.<|eos|>"


def test_chat_trains_exactly_the_assistant_replies_and_their_end_of_turn(tiny):
    example = tokenize_record({"conversation": CHAT}, "chat", tiny, fields={"messages": "conversation"})
    encoding = tiny(CHAT_TEXT, add_special_tokens=False, return_offsets_mapping=True)
    assert example.input_ids == encoding["input_ids"] and tiny.decode(example.input_ids) == CHAT_TEXT
    assert trained_text(tiny, example) == "The capital of France is Paris.<|im_end|>Rome.<|im_end|>"
    replies = [(CHAT_TEXT.index(reply), CHAT_TEXT.index(reply) + len(reply))
               for reply in ("The capital of France is Paris.<|im_end|>", "Rome.<|im_end|>")]
    for token, label, (start, end) in zip(example.input_ids, example.labels, encoding["offset_mapping"]):
        inside = any(lo <= start < end <= hi for lo, hi in replies)
        assert label == (token if inside else IGNORE), (start, end)  # system, user, headers, "\n": all -100


def test_chat_without_generation_prompt_finds_the_reply_in_the_turn(tiny):
    tokenizer = load_tokenizer(tiny.name_or_path)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] + ':\n' + m['content'] + '\n\n' }}{% endfor %}"
    example = tokenize_record({"messages": CHAT[1:3]}, "chat", tokenizer)
    assert trained_text(tokenizer, example) == "The capital of France is Paris."


def test_chat_reply_found_after_its_header_and_its_first_word_trained_with_the_leading_space(tiny):
    tokenizer = load_tokenizer(tiny.name_or_path)
    # no generation prompt, the reply after ": " on the header's line: the byte-level BPE keeps the space in
    # the reply's first token, and a reply spelled inside the header ("ant" in "assistant") is still the reply
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    for reply in ("The capital of France is Paris.", "ant"):
        messages = [{"role": "user", "content": "Name it."}, {"role": "assistant", "content": reply}]
        example = tokenize_record({"messages": messages}, "chat", tokenizer)
        assert trained_text(tokenizer, example).strip() == reply


def test_chat_template_that_rewrites_past_turns_is_refused(tiny):
    tokenizer = load_tokenizer(tiny.name_or_path)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
                               "{{ 'assistant: (earlier reply)\n' }}{% else %}{{ m['role'] + ': ' + m['content'] + "
                               "'\n' }}{% endif %}{% endfor %}")
    with pytest.raises(DataError, match="messages 1..4 do not begin with the rendering of messages 1..3"):
        tokenize_record({"messages": CHAT}, "chat", tokenizer, source="chat.jsonl:7")


def test_chat_errors_name_the_record_and_the_fix(tiny):
    robot = [*CHAT[:2], {"role": "robot", "content": "beep"}]
    with pytest.raises(DataError, match="chat.jsonl:3: message 3 .* role 'robot'.*system, user, assistant, tool"):
        tokenize_record({"messages": robot}, "chat", tiny, source="chat.jsonl:3")
    with pytest.raises(DataError, match="has none: set `tokenizer.chat_template`.*'prompt_completion'"):
        tokenize_record({"messages": CHAT}, "chat", ByteTokenizer())
    no_template = load_tokenizer(tiny.name_or_path)
    no_template.chat_template = None
    with pytest.raises(DataError, match="chat.jsonl:4: format 'chat' .* has none: set `tokenizer.chat_template`"):
        tokenize_record({"messages": CHAT}, "chat", no_template, source="chat.jsonl:4")
    with pytest.raises(UntrainableRecordError, match="chat.jsonl:5: the record has no token to train on"):
        tokenize_record({"messages": CHAT[:2]}, "chat", tiny, source="chat.jsonl:5")


def test_missing_field_names_the_record_the_field_and_the_fields_it_has():
    record = {"question": "2+2=", "answer": "4"}
    with pytest.raises(DataError, match=r"qa.jsonl:9: the record has no field 'prompt' .*its fields are "
                                        r"\['answer', 'question'\], or map another field"):
        tokenize_record(record, "prompt_completion", ByteTokenizer(), source="qa.jsonl:9")
    with pytest.raises(DataError, match="no field 'body' \\(format 'text' reads its 'text' from 'body'\\)"):
        tokenize_record(record, "text", ByteTokenizer(), fields={"text": "body"})
    with pytest.raises(InvalidValueError, match="fields maps \\['messages'\\], which format 'text' does not read"):
        tokenize_record(record, "text", ByteTokenizer(), fields={"messages": "conversation"})
    with pytest.raises(DataError, match="field 'text' .* must be text \\(a str\\), got int"):
        tokenize_record({"text": 3}, "text", ByteTokenizer())


def test_byte_tokenizer_offsets_map_each_byte_to_its_character():
    tokenizer, text = ByteTokenizer(), "naïve €5 🙂"
    encoding = tokenizer(text, return_offsets_mapping=True)
    assert encoding["input_ids"] == list(text.encode("utf-8")) and tokenizer.vocab_size == 259
    expected = [(i, i + 1) for i, char in enumerate(text) for _ in char.encode("utf-8")]
    assert encoding["offset_mapping"] == expected
    assert expected[2:4] == [(2, 3), (2, 3)] and expected[-4:] == [(9, 10)] * 4  # ï: 2 bytes, 🙂: 4
    assert tokenizer.decode(encoding["input_ids"] + [tokenizer.eos_token_id]) == text + "<|eos|>"
    assert tokenizer.decode([110, 257, 258], skip_special_tokens=True) == "n"
    example = tokenize_record({"prompt": "€", "completion": "é"}, "prompt_completion", tokenizer)
    assert example.input_ids == [0xE2, 0x82, 0xAC, 0xC3, 0xA9, 257] and example.labels[:3] == [IGNORE] * 3


def test_load_tokenizer_picks_the_directorys_own_or_bytes(tmp_path, tiny):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)  # no tokenizer files, no model config
    assert load_tokenizer(tiny.name_or_path).chat_template == tiny.chat_template
    write(tmp_path / "config.json", json.dumps({"vocab_size": 32000}))
    with pytest.raises(DataError, match="vocabulary of 32000 tokens.*copy the tokenizer files"):
        load_tokenizer(tmp_path)


# ---- many records: overflow, untrainable records, the summary


def test_truncate_and_split_are_counted_and_split_pieces_rebuild_the_document():
    tokenizer, document = ByteTokenizer(), {"text": "abcdefghij"}  # 10 bytes + eos = 11 tokens
    whole = tokenize_record(document, "text", tokenizer)
    cut, summary = tokenize_records([document], "text", tokenizer, seq_len=4)
    assert [e.input_ids for e in cut] == [whole.input_ids[:4]]
    assert (summary.truncated, summary.truncated_tokens, summary.split) == (1, 7, 0)
    pieces, summary = tokenize_records([("d.txt", 1, document)], "text", tokenizer, seq_len=4, overflow="split")
    assert [len(p.input_ids) for p in pieces] == [4, 4, 3] and [p.source for p in pieces] == ["d.txt:1#1",
                                                                                              "d.txt:1#2", "d.txt:1#3"]
    assert sum((p.input_ids for p in pieces), []) == whole.input_ids
    assert sum((p.labels for p in pieces), []) == whole.labels
    assert (summary.split, summary.truncated, summary.examples, summary.tokens) == (1, 0, 3, 11)
    assert summary.trainable_tokens == 3 + 3 + 2  # each piece's first token is no target
    assert pack([len(p.input_ids) for p in pieces], 8) == [[0, 1], [2]]  # ready for packing


def test_split_drops_and_counts_pieces_with_nothing_to_train_and_truncate_an_untrainable_rest():
    record = {"prompt": "12345678", "completion": "x"}  # 8 prompt tokens, then x and eos
    pieces, summary = tokenize_records([record], "prompt_completion", ByteTokenizer(), seq_len=4, overflow="split")
    assert [p.input_ids for p in pieces] == [[ord("x"), 257]] and summary.dropped_pieces == 2
    with pytest.raises(UntrainableRecordError, match="record:1: no token to train on is left .* seq_len 4"):
        tokenize_records([record], "prompt_completion", ByteTokenizer(), seq_len=4)
    _, summary = tokenize_records([record], "prompt_completion", ByteTokenizer(), seq_len=4, on_untrainable="skip")
    assert (summary.records, summary.examples, summary.skipped_untrainable, summary.truncated) == (1, 0, 1, 1)


def test_summary_counts_every_record_read_from_files(tmp_path):
    rows = [{"text": "hello"}, {"text": ""}, {"text": "a longer document"}, {"text": "ok"}]
    path = write(tmp_path / "d.jsonl", "\n".join(json.dumps(r) for r in rows))
    with pytest.raises(UntrainableRecordError, match="d.jsonl:2: the record has no token to train on"):
        tokenize_records(iter_records(path), "text", ByteTokenizer())
    examples, summary = tokenize_records(iter_records(path), "text", ByteTokenizer(), seq_len=8,
                                         on_untrainable="skip")
    assert [e.source for e in examples] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert summary == DataSummary(records=4, examples=3, skipped_untrainable=1, truncated=1, truncated_tokens=10,
                                  tokens=6 + 8 + 3, trainable_tokens=5 + 7 + 2)
    assert "skipped untrainable 1" in summary.describe()
    with pytest.raises(InvalidValueError, match="overflow must be one of truncate, split"):
        tokenize_records([], "text", ByteTokenizer(), overflow="wrap")
