"""The decoding loop, transformers' `generate` semantics for decoder-only models: left-padded prompts (their
`attention_mask`), positions counted from each row's first real token, one token per row per step, a row
that produced an end-of-sequence token continues with `pad_token_id` until every row has finished or
`max_new_tokens` are made. The loop knows nothing of the layout: `forward(ids, positions, documents)`
returns the logits (b, s, V) of the given positions, whatever runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.attention import PADDING, Documents
from paratrain.errors import InvalidValueError
from paratrain.generation.kv_cache import DecodeRows, kv_caches
from paratrain.generation.sampling import next_tokens

Forward = Callable[[torch.Tensor, torch.Tensor, Documents | None], torch.Tensor]


@dataclass(frozen=True)
class GenerationSettings:
    """transformers' names and meanings; `top_k` defaults to none (transformers' GenerationConfig: 50)."""

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    use_cache: bool = True

    def check(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidValueError(f"generate(max_new_tokens={self.max_new_tokens!r}): give a positive integer")
        if self.do_sample and not self.temperature > 0:
            raise InvalidValueError(f"generate(temperature={self.temperature!r}): sampling needs a temperature > 0 "
                                    f"(or do_sample=False for greedy decoding)")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InvalidValueError(f"generate(top_p={self.top_p!r}): give a probability in (0, 1]")

    @property
    def eos_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    @property
    def pad_id(self) -> int:
        """What a finished row continues with: pad_token_id, else (as transformers does) the first eos id."""
        return self.pad_token_id if self.pad_token_id is not None else (self.eos_ids or [0])[0]


def prompt_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' document ids (0 real, -1 padding) and positions (transformers' cumsum of the mask - 1);
    right padding is refused by name (the next token would follow a pad)."""
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise InvalidValueError(f"generate(input_ids=...) takes (batch, prompt length) token ids, got "
                                f"{tuple(input_ids.shape)} {input_ids.dtype}")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device).long()
    if mask.shape != input_ids.shape:
        raise InvalidValueError(f"generate(attention_mask=...) has shape {tuple(mask.shape)}, input_ids "
                                f"{tuple(input_ids.shape)}: give one mask entry per prompt token")
    if bool((mask[:, 1:] < mask[:, :-1]).any()) or bool((mask[:, -1] == 0).any()):
        raise InvalidValueError("generate(attention_mask=...) pads a prompt on the right (or ends it with "
                                "padding): pad prompts on the left (tokenizer.padding_side = 'left'), as "
                                "transformers' generate expects for decoder-only models")
    documents = torch.where(mask.bool(), 0, PADDING)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return documents, positions


def _pad_to_multiple(ids, positions, documents, multiple: int):
    """Sequence parallelism needs a multiple of tp tokens per forward: pads after the chunk (never attended)."""
    extra = -ids.shape[1] % multiple
    if not extra:
        return ids, positions, documents
    b = ids.shape[0]
    return (torch.cat([ids, ids[:, -1:].expand(b, extra)], 1),
            torch.cat([positions, positions[:, -1:].expand(b, extra)], 1),
            torch.cat([documents, torch.full((b, extra), PADDING, dtype=documents.dtype, device=ids.device)], 1))


def decode(forward: Forward, module: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
           settings: GenerationSettings, generator: torch.Generator | None = None, multiple: int = 1) -> torch.Tensor:
    """The prompts followed by up to max_new_tokens tokens per row: (b, prompt + generated)."""
    documents, positions = prompt_layout(input_ids, attention_mask)
    out, finished = input_ids, torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    eos = torch.tensor(settings.eos_ids, dtype=input_ids.dtype, device=input_ids.device)
    rows = DecodeRows(documents[:, :0])
    chunk = (input_ids, positions, documents)  # what the next forward brings (cached: only the new tokens)
    with kv_caches(module, rows) if settings.use_cache else nullcontext():
        for _ in range(settings.max_new_tokens):
            ids, pos, docs = _pad_to_multiple(*chunk, multiple)
            if settings.use_cache:
                rows.extend(docs)
                logits = forward(ids, pos, None)  # the cores read the rows' documents from the cache
                rows.seen += ids.shape[1]
            else:
                logits = forward(ids, pos, Documents(docs) if bool((docs == PADDING).any()) else None)
            last = logits[:, chunk[0].shape[1] - 1]
            token = next_tokens(last, settings.do_sample, settings.temperature, settings.top_k, settings.top_p,
                                generator)
            token = torch.where(finished, settings.pad_id, token)
            out = torch.cat([out, token[:, None]], dim=1)
            if eos.numel():
                finished |= torch.isin(token, eos)
                if bool(finished.all()):
                    break
            new = (token[:, None], chunk[1][:, -1:] + 1, torch.zeros_like(chunk[2][:, -1:]))
            chunk = new if settings.use_cache else tuple(torch.cat([a, b], 1) for a, b in zip(chunk, new))
    return out

