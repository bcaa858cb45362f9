"""Collators for objective data: preference pairs (DPO) and scored completions (GRPO), as TRL collates them.

    collate = PreferenceCollator(pad_token_id=0, pad_to=64)
    batch = collate([{"prompt_ids": [...], "chosen_ids": [...], "rejected_ids": [...]}, ...])
    # {"input_ids", "attention_mask", "completion_mask"}: the chosen rows, then the rejected rows

    collate = CompletionCollator(pad_token_id=0, prompt_len=8, completion_len=8)
    batch = collate([{"prompt_ids": [...], "completion_ids": [...], "advantage": 0.5}, ...])
    # {"prompt_ids" (left-padded), "prompt_mask", "completion_ids" (right-padded), "completion_mask", "advantages"}

`pad_to` pads every micro-batch to one length (context parallelism splits a fixed length; a fixed shape also keeps
the batch checks quiet); `None` pads to the longest row, as TRL does. Optional per-example values ride along:
`ref_chosen_logps` / `ref_rejected_logps` (precomputed reference), `old_per_token_logps` / `ref_per_token_logps`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.errors import InvalidValueError


def _padded(rows: list[list[int]], length: int, value: int, left: bool = False) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            if left:
                out[i, length - len(row):] = torch.as_tensor(row, dtype=torch.long)
            else:
                out[i, :len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out


def _length(rows: list[list[int]], pad_to: int | None, what: str) -> int:
    longest = max((len(r) for r in rows), default=0)
    if pad_to is None:
        return longest
    if longest > pad_to:
        raise InvalidValueError(f"a {what} of {longest} tokens is longer than the collator's pad_to={pad_to}: raise "
                                f"data.seq_len or truncate the rows")
    return pad_to


def _ids(example: dict, key: str) -> list[int]:
    value = example.get(key)
    if value is None:
        raise InvalidValueError(f"a preference example needs `{key}` (token ids); got keys {sorted(example)}")
    return [int(t) for t in value]


@dataclass
class PreferenceCollator:
    pad_token_id: int
    pad_to: int | None = None

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        prompts = [_ids(e, "prompt_ids") for e in examples]
        chosen = [p + _ids(e, "chosen_ids") for p, e in zip(prompts, examples)]
        rejected = [p + _ids(e, "rejected_ids") for p, e in zip(prompts, examples)]
        rows = chosen + rejected
        length = _length(rows, self.pad_to, "prompt with its completion")
        masks = [[0] * len(p) + [1] * (len(r) - len(p)) for p, r in zip(prompts + prompts, rows)]
        out = {"input_ids": _padded(rows, length, self.pad_token_id),
               "attention_mask": _padded([[1] * len(r) for r in rows], length, 0),
               "completion_mask": _padded(masks, length, 0)}
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in examples[0]:
                out[key] = torch.tensor([float(e[key]) for e in examples], dtype=torch.float64)
        return out


@dataclass
class CompletionCollator:
    pad_token_id: int
    prompt_len: int | None = None
    completion_len: int | None = None

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        prompts = [_ids(e, "prompt_ids") for e in examples]
        completions = [_ids(e, "completion_ids") for e in examples]
        p = _length(prompts, self.prompt_len, "prompt")
        c = _length(completions, self.completion_len, "completion")
        out = {"prompt_ids": _padded(prompts, p, self.pad_token_id, left=True),
               "prompt_mask": _padded([[1] * len(r) for r in prompts], p, 0, left=True),
               "completion_ids": _padded(completions, c, self.pad_token_id),
               "completion_mask": _padded([[1] * len(r) for r in completions], c, 0),
               "advantages": torch.tensor([float(e["advantage"]) for e in examples], dtype=torch.float32)}
        for key in ("old_per_token_logps", "ref_per_token_logps"):
            if key in examples[0]:
                values = torch.zeros(len(examples), c, dtype=torch.float64)
                for i, e in enumerate(examples):
                    values[i, :len(e[key])] = torch.as_tensor(e[key], dtype=torch.float64)
                out[key] = values
        return out
