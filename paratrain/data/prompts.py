"""Prompts for sample generations, in a job's data format, as the model sees them when asked to continue.

A prompt is a record of the job's format or a plain string: "text" continues `text`; "prompt_completion"
continues `prompt` (as training encodes it, before the completion); "chat" renders `messages` with the
tokenizer's chat template and its generation prompt (trailing assistant turns, an expected answer, are left
out), a string being one user turn. The `fields` mapping of the data section applies.
"""

from __future__ import annotations

from collections.abc import Mapping

from paratrain.data.formats import _encode, _field_names, _render  # the training formats' own rules
from paratrain.data.sources import DataError

_CANONICAL = {"text": "text", "prompt_completion": "prompt", "chat": "messages"}


def prompt_ids(record, fmt: str, tokenizer, fields: Mapping[str, str] | None = None,
               source: str = "trainer.samples.prompts") -> tuple[str, list[int]]:
    """(the prompt's text, its token ids)."""
    canonical = _CANONICAL[fmt]
    if isinstance(record, str):
        value = [{"role": "user", "content": record}] if fmt == "chat" else record
    elif isinstance(record, Mapping):
        key = _field_names(fmt, fields)[canonical]
        if key not in record:
            raise DataError(f"{source}: a {fmt!r} prompt needs the field {key!r}, got {sorted(record)}; give it, "
                            f"or write the prompt as a plain string")
        value = record[key]
    else:
        raise DataError(f"{source}: a prompt is a string or a record of the data format, got {type(record).__name__}")
    if fmt != "chat":
        if not isinstance(value, str):
            raise DataError(f"{source}: the {canonical!r} of a prompt must be text, got {type(value).__name__}")
        return value, _encode(tokenizer, value, special=True)
    messages = list(value)
    while messages and messages[-1].get("role") == "assistant":
        messages.pop()  # the expected answer: the model writes its own
    if not messages:
        raise DataError(f"{source}: a chat prompt needs at least one message before the assistant's answer")
    text = _render(tokenizer, messages, source, generation_prompt=True)
    return text, _encode(tokenizer, text, special=False)
