"""Preference records into token-id pairs: what a DPO job trains on (`data.format: "preference"`, docs/data.md).

    pair = tokenize_pair({"prompt": "2+2=", "chosen": " 4", "rejected": " 5"}, tokenizer)
    pairs, summary = tokenize_pairs(iter_records("pairs.jsonl"), tokenizer, seq_len=512)
    data = Pairs(pairs, seq_len=512, pad_id=0)      # data[i]: {"prompt_ids", "chosen_ids", "rejected_ids"}
    data.collate_fn(...)                             # PreferenceCollator(pad_to=seq_len): TRL's collated form

TRL's standard preference rows, as TRL 1.16's DPOTrainer prepares them (`_prepare_dataset`):
  plain           {"prompt": str, "chosen": str, "rejected": str}: the prompt with the tokenizer's special tokens
                  (e.g. bos), and each completion followed by eos (when it does not end with it already);
  conversational  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}: rendered by the tokenizer's
                  chat template, the prompt with its generation prompt ("<|im_start|>assistant\\n"); chosen and
                  rejected are the assistant's turn(s), whose end-of-turn marker the template writes;
  implicit prompt {"chosen", "rejected"} only (or a prompt of the other kind): the prompt is their longest common
                  prefix, as TRL's `extract_prompt` finds it (characters of text, whole messages of a conversation).
Each completion's tokens are where the tokenized prompt + completion leaves the tokenized prompt (TRL's
`common_prefix_length`), so a BPE merge across the edge cannot move it. A pair longer than seq_len is cut as TRL's
`max_length` with `truncation_mode="keep_start"` cuts it: prompt + completion to its first seq_len tokens, each
completion apart (an eos may be cut off); a prompt that leaves no room for a completion token is untrainable
(TRL drops it). Pairs are never packed: each is its own two rows, padded to seq_len.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from torch.utils.data import Dataset

from paratrain.data.formats import ROLES, DataSummary, UntrainableRecordError, _encode, _render
from paratrain.data.preference import PreferenceCollator
from paratrain.data.sources import DataError
from paratrain.errors import InvalidValueError

PAIR_FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class Pair:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    source: str  # "file:number"

    def tokens(self) -> int:
        return 2 * len(self.prompt_ids) + len(self.chosen_ids) + len(self.rejected_ids)


def extract_prompt(chosen: Sequence, rejected: Sequence) -> tuple[Sequence, Sequence, Sequence]:
    """(prompt, chosen, rejected): the longest common prefix of chosen and rejected is the prompt, as TRL's
    `extract_prompt` (a space just before the point where they part goes to the completions, not the prompt)."""
    common = 0
    while common < min(len(chosen), len(rejected)) and chosen[common] == rejected[common]:
        common += 1
    if isinstance(chosen, str) and common and chosen[common - 1] == " ":
        common -= 1
    return chosen[:common], chosen[common:], rejected[common:]


def field_names(fields: Mapping[str, str] | None) -> dict[str, str]:
    """The format's field -> the record's field to read it from (`data.fields`)."""
    mapping = dict(fields or {})
    unknown = sorted(set(mapping) - set(PAIR_FIELDS))
    if unknown:
        raise InvalidValueError(f"data.fields maps {unknown}, which format 'preference' does not read; it reads "
                                f"{list(PAIR_FIELDS)}, e.g. fields={{'chosen': 'your_name'}}")
    return {name: mapping.get(name, name) for name in PAIR_FIELDS}


def tokenize_pair(record: Mapping, tokenizer, *, fields: Mapping[str, str] | None = None,
                  source: str = "record") -> Pair:
    """One preference record as token ids (see the module docstring); `source` names it in errors."""
    names = field_names(fields)
    if not isinstance(record, Mapping):
        raise DataError(f"{source}: a record must be an object of fields, got {type(record).__name__}")
    for name in ("chosen", "rejected"):
        if names[name] not in record:
            raise DataError(f"{source}: the record has no field {names[name]!r} (format 'preference' reads the "
                            f"{name} completion from it); its fields are {sorted(map(str, record))}: give every "
                            f"record 'chosen' and 'rejected' (and 'prompt' unless it is their common beginning), or "
                            f"map yours with data.fields, e.g. {{{name!r}: 'your_name'}}")
    chosen, rejected = record[names["chosen"]], record[names["rejected"]]
    prompt = record.get(names["prompt"])
    conversational = isinstance(chosen, list)
    if isinstance(rejected, list) != conversational or not isinstance(chosen, (str, list)):
        raise DataError(f"{source}: 'chosen' and 'rejected' must both be text or both lists of messages, got "
                        f"{type(chosen).__name__} and {type(rejected).__name__}")
    if prompt is None or isinstance(prompt, list) != conversational:  # TRL's maybe_extract_prompt
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if not value or (conversational and not any(m.get("content") for m in value if isinstance(m, Mapping))):
            raise DataError(f"{source}: the {name} completion is empty"
                            + (" once the common beginning of chosen and rejected is taken as the prompt"
                               if names["prompt"] not in record else "")
                            + ": give every pair two non-empty completions, or remove the record")
    if conversational:
        return _conversation(prompt, chosen, rejected, tokenizer, source)
    if not isinstance(prompt, str):
        raise DataError(f"{source}: 'prompt' must be text like 'chosen' and 'rejected', got {type(prompt).__name__}")
    prompt_ids = _encode(tokenizer, prompt, special=True)
    whole = [_with_eos(_encode(tokenizer, prompt + completion, special=True), tokenizer)
             for completion in (chosen, rejected)]
    return _split(prompt_ids, whole, source)


def _conversation(prompt: list, chosen: list, rejected: list, tokenizer, source: str) -> Pair:
    for name, messages in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        _check_messages(messages, name, source)
    for name, messages in (("chosen", chosen), ("rejected", rejected)):
        if messages[0]["role"] != "assistant":
            raise DataError(f"{source}: the {name} completion begins with a {messages[0]['role']!r} message; a "
                            f"conversational completion is the assistant's reply (role 'assistant'), the messages "
                            f"before it are the prompt")
    if not prompt:
        raise DataError(f"{source}: the conversation has no prompt (no message before the assistant's reply): give "
                        f"'prompt' the user's turn, or begin chosen and rejected with the same user message")
    text = _render(tokenizer, prompt, source, generation_prompt=True)
    prompt_ids = _encode(tokenizer, text, special=False)  # the template writes the special tokens (TRL's way)
    whole = [_encode(tokenizer, _render(tokenizer, prompt + completion, source), special=False)
             for completion in (chosen, rejected)]
    return _split(prompt_ids, whole, source)


def _check_messages(messages: list, name: str, source: str) -> None:
    for number, message in enumerate(messages, 1):
        if not (isinstance(message, Mapping) and "role" in message and isinstance(message.get("content"), str)):
            raise DataError(f"{source}: message {number} of {name!r} must be an object with 'role' and 'content' "
                            f"(text), got {message!r:.80}")
        if message["role"] not in ROLES:
            raise DataError(f"{source}: message {number} of {name!r} has role {message['role']!r}, which the chat "
                            f"templates do not know; the roles are {', '.join(ROLES)}")


def _split(prompt_ids: list[int], whole: list[list[int]], source: str) -> Pair:
    """The completions start where prompt + completion leaves the tokenized prompt (TRL's common_prefix_length)."""
    start = min(_common_prefix(prompt_ids, ids) for ids in whole)
    chosen, rejected = (ids[start:] for ids in whole)
    for name, ids in (("chosen", chosen), ("rejected", rejected)):
        if not ids:
            raise DataError(f"{source}: the {name} completion has no token after the prompt; give every pair two "
                            f"non-empty completions, or remove the record")
    return Pair(prompt_ids[:start], chosen, rejected, source)


def _common_prefix(ids: list[int], other: list[int]) -> int:
    n = 0
    while n < min(len(ids), len(other)) and ids[n] == other[n]:
        n += 1
    return n


def _with_eos(ids: list[int], tokenizer) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return ids + [eos] if eos is not None and ids[-1:] != [eos] else ids


def fit_pair(pair: Pair, seq_len: int | None, summary: DataSummary) -> Pair:
    """The pair within seq_len (TRL's keep_start), counted; UntrainableRecordError when the prompt fills it."""
    if seq_len is None:
        return pair
    room = seq_len - len(pair.prompt_ids)
    if room < 1:
        raise UntrainableRecordError(f"{pair.source}: the prompt has {len(pair.prompt_ids)} tokens, which leave no "
                                     f"completion token within data.seq_len {seq_len}; raise data.seq_len, shorten "
                                     f"the prompt, or set data.on_untrainable \"skip\" (TRL drops such pairs)")
    cut = len(pair.chosen_ids[room:]) + len(pair.rejected_ids[room:])
    if cut:
        summary.truncated += 1
        summary.truncated_tokens += cut
    return Pair(pair.prompt_ids, pair.chosen_ids[:room], pair.rejected_ids[:room], pair.source)


def tokenize_pairs(records: Iterable, tokenizer, *, fields: Mapping[str, str] | None = None,
                   seq_len: int | None = None, on_untrainable: str = "error") -> tuple[list[Pair], DataSummary]:
    """Every preference record as a Pair within seq_len, and the summary (examples: pairs; tokens: both rows'
    real tokens; trainable tokens: the completions'). `records`: iter_records' (file, number, record) triples,
    or plain records."""
    field_names(fields)  # a bad mapping fails before any record is read
    summary, pairs = DataSummary(), []
    for index, item in enumerate(records, 1):
        file, number, record = item if isinstance(item, tuple) else ("record", index, item)
        summary.records += 1
        try:
            pair = fit_pair(tokenize_pair(record, tokenizer, fields=fields, source=f"{file}:{number}"), seq_len,
                            summary)
        except UntrainableRecordError:
            if on_untrainable == "error":
                raise
            summary.skipped_untrainable += 1
            continue
        summary.examples += 1
        summary.tokens += pair.tokens()
        summary.trainable_tokens += len(pair.chosen_ids) + len(pair.rejected_ids)
        pairs.append(pair)
    return pairs, summary


class Pairs(Dataset):
    """Preference pairs as samples the data-parallel sampler deals out (one sample: a pair, two rows once
    collated); `collate_fn` collates them into TRL's preference form padded to seq_len."""

    sequences_per_sample = 2  # a pair is trained as its chosen and its rejected row

    def __init__(self, pairs: Sequence[Pair], seq_len: int, pad_id: int):
        if not pairs:
            raise InvalidValueError("no preference pairs: the dataset is empty after tokenization")
        longest = max(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs)
        if longest > seq_len:
            raise InvalidValueError(f"a pair has a row of {longest} tokens, more than seq_len {seq_len}; cut pairs "
                                    f"with tokenize_pairs(..., seq_len=seq_len)")
        self.pairs, self.seq_len = list(pairs), seq_len
        self.collate_fn = PreferenceCollator(pad_token_id=pad_id, pad_to=seq_len)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        pair = self.pairs[i]
        return {"prompt_ids": pair.prompt_ids, "chosen_ids": pair.chosen_ids, "rejected_ids": pair.rejected_ids}

    def padding_fraction(self, indices: Sequence[int]) -> float:
        """The share of the collated rows' positions that are padding."""
        return 1.0 - sum(self.pairs[i].tokens() for i in indices) / (2 * len(indices) * self.seq_len)
