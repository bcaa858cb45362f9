"""Dataset records into token ids and labels: what a fine-tuning job trains on, ready for `packing.py`.

    example = tokenize_record({"prompt": "2+2=", "completion": " 4"}, "prompt_completion", tokenizer)
    examples, summary = tokenize_records(iter_records("train.jsonl"), "chat", tokenizer, seq_len=2048)

Formats (the fields each reads; `fields={"prompt": "question"}` reads a record's "question" as the prompt):
  text               {"text"}: loss on every token, eos appended when the tokenizer has one;
  prompt_completion  {"prompt", "completion"}: the prompt (with the tokenizer's special tokens, e.g. bos)
                     then the completion and eos, tokenized apart so the completion's tokens are exactly its
                     own; loss on the completion and eos only;
  chat               {"messages": [{"role", "content"}, ...]}: rendered by the tokenizer's chat template;
                     loss on the assistant turns only (see the note).
Labels are transformers' form: unshifted (the shift to targets happens once, in `micro_batch.py`), IGNORE
(-100) where nothing is learned.

Nothing is dropped silently: a record with no trainable token raises `UntrainableRecordError` (or is skipped
and counted with `on_untrainable="skip"`), and `DataSummary` counts what truncation and splitting did.

[Note: trainable tokens]
A token trains the model when its label is not IGNORE and it is not the example's first token: position 0's
label is never a target, since nothing precedes it (after the shift, position t predicts label t + 1). So an
example of a single token, or a split piece whose only trained token is its first, trains nothing.

[Note: the chat mask]
Which characters an assistant wrote is found on the rendered text, never by tokenizing pieces apart: for
assistant message i, the rendering of messages[:i] with the generation prompt (e.g. "<|im_start|>assistant\\n")
ends where its reply starts, and the rendering of messages[:i + 1] ends after its end-of-turn marker (trailing
whitespace, like ChatML's "\\n" after "<|im_end|>", is not generated, so not trained; spaces or tabs just before
the reply are the reply's, so a token " The" that keeps its leading space is trained). A template without a
generation prompt is handled by finding the content itself in the new turn (its last occurrence: the header
before it may contain the same letters). This needs each rendering to
begin with the previous one (the prefix property), checked for every message: a template that rewrites past
turns (e.g. drops earlier reasoning) is refused by name. The whole text is then tokenized once, with offsets,
and a token is trained iff its characters lie inside an assistant span, so a BPE merge across a turn's edge
cannot shift the mask: a token that straddles the edge is not trained.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from paratrain.data.micro_batch import IGNORE
from paratrain.data.sources import DataError
from paratrain.errors import InvalidValueError

FORMAT_FIELDS = {"text": ("text",), "prompt_completion": ("prompt", "completion"), "chat": ("messages",)}
ROLES = ("system", "user", "assistant", "tool")
OVERFLOW = ("truncate", "split")
ON_UNTRAINABLE = ("error", "skip")


class UntrainableRecordError(DataError):
    """A record (or all of what is left of it after truncation) with no token to learn."""


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # unshifted; IGNORE where nothing is learned
    source: str  # "file:number" (sources.py), "file:number#piece" for a split piece

    def trainable_tokens(self) -> int:
        """Tokens that train the model (see the note: never the first)."""
        return sum(label != IGNORE for label in self.labels[1:])


@dataclass
class DataSummary:
    """What `tokenize_records` did, every record accounted for."""

    records: int = 0  # read
    examples: int = 0  # produced (a split record counts once per kept piece)
    skipped_untrainable: int = 0  # records with no trainable token (on_untrainable="skip")
    truncated: int = 0  # records cut to seq_len
    truncated_tokens: int = 0  # tokens those cuts dropped
    split: int = 0  # records cut into pieces of seq_len
    dropped_pieces: int = 0  # pieces with no trainable token
    tokens: int = 0  # in the examples
    trainable_tokens: int = 0  # in the examples

    def describe(self) -> str:
        return ", ".join(f"{field.name.replace('_', ' ')} {getattr(self, field.name)}"
                         for field in dataclasses.fields(self))


def tokenize_record(record: Mapping, fmt: str, tokenizer, *, fields: Mapping[str, str] | None = None,
                    source: str = "record") -> Example:
    """One record as an Example in format `fmt` (see the module docstring); `source` names the record in
    errors. A record with no trainable token raises UntrainableRecordError."""
    names = _field_names(fmt, fields)
    if not isinstance(record, Mapping):
        raise DataError(f"{source}: a record must be an object of fields, got {type(record).__name__}")
    values = {canonical: _field(record, key, canonical, fmt, source) for canonical, key in names.items()}
    if fmt == "text":
        ids = _with_eos(_encode(tokenizer, values["text"], special=True), tokenizer)
        labels = list(ids)
    elif fmt == "prompt_completion":
        prompt = _encode(tokenizer, values["prompt"], special=True)
        completion = _with_eos(_encode(tokenizer, values["completion"], special=False), tokenizer)
        ids, labels = prompt + completion, [IGNORE] * len(prompt) + completion
    else:
        ids, labels = _chat(values["messages"], tokenizer, source, names["messages"])
    example = Example(ids, labels, source)
    if not example.trainable_tokens():
        raise UntrainableRecordError(f"{source}: the record has no token to train on ({len(ids)} tokens, "
                                     f"{_nothing_trained(fmt)}); fix or remove it, or pass on_untrainable='skip' "
                                     f"to skip such records (they are counted)")
    return example


def tokenize_records(records: Iterable, fmt: str, tokenizer, *, fields: Mapping[str, str] | None = None,
                     seq_len: int | None = None, overflow: str = "truncate",
                     on_untrainable: str = "error") -> tuple[list[Example], DataSummary]:
    """Every record as Examples, and the summary of what was done. `records`: iter_records' (file, number,
    record) triples, or plain records (numbered from 1). An example longer than `seq_len` is cut to it
    (`overflow="truncate"`) or cut into consecutive pieces of at most seq_len (`"split"`), pieces with no
    trainable token dropped; `on_untrainable="skip"` skips records with no trainable token instead of raising."""
    _check_choice("overflow", overflow, OVERFLOW)
    _check_choice("on_untrainable", on_untrainable, ON_UNTRAINABLE)
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 2):
        raise InvalidValueError(f"seq_len must be an int of at least 2 (a token and the one it predicts), got "
                                f"{seq_len!r}")
    _field_names(fmt, fields)  # a bad format or mapping fails before any record is read
    summary, examples = DataSummary(), []
    for index, item in enumerate(records, 1):
        file, number, record = item if isinstance(item, tuple) else ("record", index, item)
        summary.records += 1
        try:
            example = tokenize_record(record, fmt, tokenizer, fields=fields, source=f"{file}:{number}")
            pieces = _fit(example, seq_len, overflow, summary)
        except UntrainableRecordError:
            if on_untrainable == "error":
                raise
            summary.skipped_untrainable += 1
            continue
        for piece in pieces:
            summary.examples += 1
            summary.tokens += len(piece.input_ids)
            summary.trainable_tokens += piece.trainable_tokens()
        examples += pieces
    return examples, summary


def _fit(example: Example, seq_len: int | None, overflow: str, summary: DataSummary) -> list[Example]:
    """The example within seq_len, counted in the summary; UntrainableRecordError when nothing trainable is
    left."""
    length = len(example.input_ids)
    if seq_len is None or length <= seq_len:
        return [example]
    if overflow == "truncate":
        summary.truncated += 1
        summary.truncated_tokens += length - seq_len
        pieces = [Example(example.input_ids[:seq_len], example.labels[:seq_len], example.source)]
    else:
        summary.split += 1
        starts = range(0, length, seq_len)
        pieces = [Example(example.input_ids[start:start + seq_len], example.labels[start:start + seq_len],
                          f"{example.source}#{k}") for k, start in enumerate(starts, 1)]
    kept = [piece for piece in pieces if piece.trainable_tokens()]
    if overflow == "split":
        summary.dropped_pieces += len(pieces) - len(kept)
    if not kept:
        raise UntrainableRecordError(f"{example.source}: no token to train on is left after cutting its {length} "
                                     f"tokens to seq_len {seq_len} ({overflow}); raise seq_len, shorten the "
                                     f"prompt, or pass on_untrainable='skip' (such records are counted)")
    return kept


def _field_names(fmt: str, fields: Mapping[str, str] | None) -> dict[str, str]:
    """The format's field -> the record's field to read it from."""
    if fmt not in FORMAT_FIELDS:
        raise InvalidValueError(f"unknown data format {fmt!r}; the formats are {', '.join(FORMAT_FIELDS)}")
    mapping = dict(fields or {})
    unknown = sorted(set(mapping) - set(FORMAT_FIELDS[fmt]))
    if unknown:
        raise InvalidValueError(f"fields maps {unknown}, which format {fmt!r} does not read; it reads "
                                f"{list(FORMAT_FIELDS[fmt])}, e.g. fields={{{FORMAT_FIELDS[fmt][0]!r}: 'your_name'}}")
    return {canonical: mapping.get(canonical, canonical) for canonical in FORMAT_FIELDS[fmt]}


def _field(record: Mapping, key: str, canonical: str, fmt: str, source: str):
    read_as = f"format {fmt!r} reads its {canonical!r}" + (f" from {key!r}" if key != canonical else "")
    if key not in record:
        mapping = "" if key != canonical else f", or map another field: fields={{{canonical!r}: 'name'}}"
        raise DataError(f"{source}: the record has no field {key!r} ({read_as}); its fields are "
                        f"{sorted(map(str, record))}{mapping}")
    value = record[key]
    wanted, described = (list, "a list of messages") if canonical == "messages" else (str, "text (a str)")
    if not isinstance(value, wanted):
        raise DataError(f"{source}: field {key!r} ({read_as}) must be {described}, got {type(value).__name__}")
    return value


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _with_eos(ids: list[int], tokenizer) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return ids + [eos] if eos is not None and ids[-1:] != [eos] else ids


def _nothing_trained(fmt: str) -> str:
    return {"text": "an empty text", "prompt_completion": "an empty completion and a tokenizer without eos",
            "chat": "no assistant message, or only empty ones"}[fmt]


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InvalidValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _chat(messages: list, tokenizer, source: str, field: str) -> tuple[list[int], list[int]]:
    _check_messages(messages, source, field)
    text, spans = assistant_spans(messages, tokenizer, source)
    try:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as exc:  # transformers' slow (Python) tokenizers give no offsets
        raise DataError(f"{source}: format 'chat' needs token offsets, which {type(tokenizer).__name__} does not "
                        f"give; load the fast tokenizer (a tokenizer.json, use_fast=True)") from exc
    ids = list(encoding["input_ids"])
    labels = [token if any(lo <= start < end <= hi for lo, hi in spans) else IGNORE
              for token, (start, end) in zip(ids, encoding["offset_mapping"])]
    return ids, labels


def _check_messages(messages: list, source: str, field: str) -> None:
    for number, message in enumerate(messages, 1):
        if not (isinstance(message, Mapping) and "role" in message and "content" in message):
            got = sorted(map(str, message)) if isinstance(message, Mapping) else type(message).__name__
            raise DataError(f"{source}: message {number} of {field!r} must be an object with 'role' and 'content', "
                            f"got {got}")
        if message["role"] not in ROLES:
            raise DataError(f"{source}: message {number} of {field!r} has role {message['role']!r}; the roles "
                            f"allowed are {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise DataError(f"{source}: message {number} of {field!r} has content of type "
                            f"{type(message['content']).__name__}; it must be text")


def assistant_spans(messages: list, tokenizer, source: str = "record") -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered by the tokenizer's chat template, and the character span of each assistant
    turn in it: its reply and end-of-turn marker (see the note)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{source}: format 'chat' renders messages with the tokenizer's chat template, and this "
                        f"tokenizer ({type(tokenizer).__name__}) has none: set `tokenizer.chat_template` to the "
                        f"model's Jinja template, or use format 'prompt_completion'")
    renders = [""] + [_render(tokenizer, messages[:k], source) for k in range(1, len(messages) + 1)]
    for k in range(1, len(renders)):
        if not renders[k].startswith(renders[k - 1]):
            raise DataError(f"{source}: the chat template does not render this conversation as a sequence of turns: "
                            f"messages 1..{k} do not begin with the rendering of messages 1..{k - 1}, so the template "
                            f"rewrites earlier turns when later ones follow (e.g. drops past reasoning), and which "
                            f"characters are the assistant's cannot be told; use a template that keeps past turns "
                            f"as they are, or format 'prompt_completion'")
    spans = [_assistant_span(messages, i, renders, tokenizer, source)
             for i, message in enumerate(messages) if message["role"] == "assistant"]
    return renders[-1], spans


def _assistant_span(messages: list, i: int, renders: list[str], tokenizer, source: str) -> tuple[int, int]:
    before, after, content = renders[i], renders[i + 1], messages[i]["content"]
    start = -1
    if i > 0:
        prompt = _render(tokenizer, messages[:i], source, generation_prompt=True)
        if len(prompt) > len(before) and after.startswith(prompt):
            start = len(prompt)
    if start < 0:  # the content ends the turn but for its end marker: the last match is the reply, not the header
        start = after.rfind(content, len(before)) if content else -1
        if start < 0:
            raise DataError(f"{source}: message {i + 1} (assistant): the chat template has no generation prompt "
                            f"that begins this turn, and the turn does not contain the message's content as "
                            f"written, so its reply cannot be found; use a template with add_generation_prompt")
    found = after.find(content, start)
    content_end = found + len(content) if found >= 0 else start
    # A tokenizer that keeps a word's leading space in its token (" The") would leave the reply's first word
    # straddling the span: the spaces or tabs just before the reply belong to it (never a newline, which ends
    # the header and is not generated)
    while start > len(before) and after[start - 1] in " \t":
        start -= 1
    return start, max(len(after.rstrip()), content_end)


def _render(tokenizer, messages: list, source: str, generation_prompt: bool = False) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except DataError:
        raise
    except Exception as exc:  # Jinja's errors, and the template's own raise_exception(...)
        raise DataError(f"{source}: the chat template failed on messages 1..{len(messages)}: "
                        f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(text, str):
        raise DataError(f"{source}: the chat template rendered {type(text).__name__}, not text")
    return text
