"""The tokenizer of a fine-tuning job: the model directory's own, or bytes when the job has none.

    tokenizer = load_tokenizer("models/my-llama")   # transformers.AutoTokenizer.from_pretrained
    tokenizer = load_tokenizer(None)                # ByteTokenizer: ids 0-255 are bytes, then 3 specials

A model fine-tuned from a checkpoint must see the ids its embedding was trained on, so a directory with
tokenizer files always gives its own tokenizer. A model trained from scratch needs no vocabulary file at all:
`ByteTokenizer` has the part of transformers' call surface that `formats.py` uses (`__call__` with
`add_special_tokens` and `return_offsets_mapping`, `decode`, `eos_token_id`, `pad_token_id`,
`chat_template`), so every format but "chat" works the same with either.

A directory without tokenizer files whose config.json states a vocabulary the bytes cannot serve (fewer than
259 ids, or more than 512: a subword vocabulary whose tokenizer files were left behind) is an error rather
than bytes, since byte ids would train such a model on garbage without any other sign.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from paratrain.data.sources import DataError
from paratrain.errors import InvalidValueError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
_LARGEST_BYTE_VOCABULARY = 512  # 259 padded up for kernel-friendly shapes; more means subword tokens


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0-255 are the bytes, 256-258 the specials `<|bos|>`, `<|eos|>`, `<|pad|>`.

    Like GPT-2's tokenizer it adds no bos, with or without `add_special_tokens` (packing restarts positions
    for each document, and the formats end documents with eos). Text that spells a special ("<|eos|>") stays
    bytes, so a dataset cannot inject one. Offsets are character offsets, as transformers gives them: each
    byte of a multi-byte character maps to that character's span (start, start + 1).
    """

    bos_token, eos_token, pad_token = "<|bos|>", "<|eos|>", "<|pad|>"
    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258
    vocab_size = 259
    chat_template = None

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False) -> dict:
        """{"input_ids", "attention_mask"} of `text`, and "offset_mapping" (character spans) when asked."""
        if not isinstance(text, str):
            raise InvalidValueError(f"ByteTokenizer encodes one str at a time, got {type(text).__name__}")
        ids, offsets = _bytes_and_offsets(text)
        encoding = {"input_ids": ids, "attention_mask": [1] * len(ids)}
        if return_offsets_mapping:
            encoding["offset_mapping"] = offsets
        return encoding

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (bytes that are not valid UTF-8 become U+FFFD); specials as their names unless
        skipped."""
        specials = {self.bos_token_id: self.bos_token, self.eos_token_id: self.eos_token,
                    self.pad_token_id: self.pad_token}
        parts, run = [], bytearray()
        for token in (int(i) for i in ids):
            if 0 <= token < 256:
                run.append(token)
                continue
            if token not in specials:
                raise InvalidValueError(f"token id {token} is not in ByteTokenizer's vocabulary "
                                        f"0..{self.vocab_size - 1}")
            parts.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            parts.append("" if skip_special_tokens else specials[token])
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(self, *args, **kwargs):
        raise DataError("ByteTokenizer has no chat template: set `tokenizer.chat_template` to a Jinja template "
                        "on a transformers tokenizer (load_tokenizer(model_dir) with the model's tokenizer files), "
                        "or use format 'prompt_completion'")


def _bytes_and_offsets(text: str) -> tuple[list[int], list[tuple[int, int]]]:
    if text.isascii():
        return list(text.encode("ascii")), [(at, at + 1) for at in range(len(text))]
    ids, offsets = [], []
    for at, char in enumerate(text):
        encoded = char.encode("utf-8", errors="replace")  # a lone surrogate (from JSON "\ud800") becomes "?"
        ids += encoded
        offsets += [(at, at + 1)] * len(encoded)
    return ids, offsets


def load_tokenizer(model_dir: str | Path | None = None):
    """The tokenizer of `model_dir` (transformers' AutoTokenizer) when it has tokenizer files, else a
    ByteTokenizer (also for None)."""
    if model_dir is None:
        return ByteTokenizer()
    directory = Path(model_dir).expanduser()
    if not directory.is_dir():
        raise DataError(f"tokenizer directory {directory} does not exist (relative to {Path.cwd()}); give the "
                        f"model's directory, or none for byte tokens")
    if any((directory / name).is_file() for name in TOKENIZER_FILES):
        return _auto_tokenizer(directory)
    _check_byte_vocabulary(directory)
    return ByteTokenizer()


def _auto_tokenizer(directory: Path):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError(f"{directory} holds a transformers tokenizer; loading it needs transformers: "
                          f"pip install transformers") from None
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        raise DataError(f"the tokenizer files in {directory} cannot be loaded ({exc}); copy them again from the "
                        f"model they came with") from exc


def _check_byte_vocabulary(directory: Path) -> None:
    config = directory / "config.json"
    if not config.is_file():
        return
    try:
        vocab_size = json.loads(config.read_text(encoding="utf-8")).get("vocab_size")
    except (ValueError, AttributeError):
        return  # not a model config this check can read; the model's own loading will say more
    if isinstance(vocab_size, int) and not ByteTokenizer.vocab_size <= vocab_size <= _LARGEST_BYTE_VOCABULARY:
        raise DataError(f"{directory} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...) and its "
                        f"config.json states a vocabulary of {vocab_size} tokens, which byte tokens (ids "
                        f"0..{ByteTokenizer.vocab_size - 1}) do not fit: copy the tokenizer files of the model into "
                        f"{directory}")
