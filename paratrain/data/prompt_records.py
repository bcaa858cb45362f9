"""Prompt-only records: what a GRPO job samples its rollouts from (`data.format: "prompt"`, docs/data.md).

    prompts = read_prompts(cfg.data, tokenizer, longest=seq_len - max_completion_length)
    prompts.ids[i], prompts.mask[i]   # the prompt left-padded to the longest prompt of the file (every layout's width)
    prompts.prompts[i]                # as the reward functions get it: the text, or the messages
    prompts.columns["answer"][i]      # every other field of the record, by name

TRL's prompt-only rows: `{"prompt": str}`, tokenized with the tokenizer's special tokens as a prompt of
trainer.samples is; or `{"prompt": [messages]}`, rendered by the chat template with its generation prompt (TRL's
conversational prompts: the reward functions then get completions as `[{"role": "assistant", "content": ...}]`).
Every prompt is left-padded to the longest one in the file, so a rollout row has the same positions whichever rank
samples it. A prompt longer than `longest` (the model's positions less objective.max_completion_length) is an error
naming its file and line: it is never cut, since a cut prompt asks a different question.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from paratrain.data.prompts import prompt_ids
from paratrain.data.sources import DataError


@dataclass
class Prompts:
    ids: torch.Tensor  # (n, width) int64, left-padded with pad_id
    mask: torch.Tensor  # (n, width) int64, 0 on the padding
    prompts: list  # each prompt as the reward functions get it: its text, or its messages
    columns: dict[str, list]  # every other field of the records, one value per prompt (None where one lacks it)
    conversational: bool

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, list, dict[str, list]]:
        """(ids, mask, prompts, columns) of these prompts."""
        return (self.ids[indices], self.mask[indices], [self.prompts[i] for i in indices],
                {name: [values[i] for i in indices] for name, values in self.columns.items()})


def read_prompts(records: Iterable[tuple[str, int, dict]], tokenizer, field: str, longest: int,
                 pad_id: int) -> Prompts:
    """The prompt records (`sources.iter_records`), `field` holding the prompt, as one padded batch."""
    encoded, raw, extra, kinds = [], [], [], set()
    for source, number, record in records:
        where = f"{source} line {number}"
        if not isinstance(record, dict) or field not in record:
            got = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{where}: a \"prompt\" record needs the field {field!r} (data.fields maps another "
                            f"name to it), got {got}")
        value = record[field]
        kinds.add(isinstance(value, str))
        if len(kinds) > 1:
            raise DataError(f"{where}: data.train mixes text prompts and conversational ones (message lists); keep "
                            f"one kind, as the reward functions get every completion in one form")
        _, ids = prompt_ids(value if isinstance(value, str) else {"messages": value},
                            "text" if isinstance(value, str) else "chat", tokenizer, source=where)
        if not ids or len(ids) > longest:
            raise DataError(f"{where}: the prompt is {len(ids)} tokens; a rollout's prompt takes 1 to {longest} "
                            f"(the model's positions less objective.max_completion_length): shorten it, or "
                            f"lower objective.max_completion_length" + (" or raise data.seq_len" if ids else ""))
        encoded.append(ids)
        raw.append(value)
        extra.append({k: v for k, v in record.items() if k != field})
    if not encoded:
        raise DataError("data.train gave no prompt: a grpo job needs at least one record with a prompt")
    width = max(len(ids) for ids in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, prompt in enumerate(encoded):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    names = sorted({name for record in extra for name in record})
    columns = {name: [record.get(name) for record in extra] for name in names}
    return Prompts(ids, mask, raw, columns, conversational=not kinds.pop())
