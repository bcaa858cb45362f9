"""The decoding loop, transformers' `generate` semantics for decoder-only models: left-padded prompts (their
`attention_mask`), positions counted from each row's first real token, one token per row per step, a row
that produced an end-of-sequence token continues with `pad_token_id` until every row has finished or
`max_new_tokens` are made. The loop knows nothing of the layout: `forward(ids, positions, documents, keep)`
returns the logits (b, V) of the chunk's position `keep` (the last real one: the only one sampled from, so a
layout that gathers or sends logits moves one position's, not the prompt's), whatever runs them.
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
from paratrain.generation.sampling import keyed_next_tokens, next_tokens

Forward = Callable[[torch.Tensor, torch.Tensor, Documents | None, int], torch.Tensor]


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


Choose = Callable[[torch.Tensor, int], torch.Tensor]  # (last logits (b, V), token index) -> (b,) tokens


@dataclass
class Decoded:
    ids: torch.Tensor  # (b, prompt + new): the prompts followed by the generated tokens
    log_probs: torch.Tensor  # (b, new) fp32 log p of each generated token under logits / temperature, unwarped


def decode(forward: Forward, module: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
           settings: GenerationSettings, generator: torch.Generator | None = None, multiple: int = 1) -> torch.Tensor:
    """The prompts followed by up to max_new_tokens tokens per row: (b, prompt + generated)."""
    def choose(last: torch.Tensor, index: int) -> torch.Tensor:
        return next_tokens(last, settings.do_sample, settings.temperature, settings.top_k, settings.top_p, generator)

    return _decode(forward, module, input_ids, attention_mask, settings, choose, multiple).ids


def decode_rollout(forward: Forward, module: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   settings: GenerationSettings, keys: torch.Tensor, multiple: int = 1,
                   all_finished: Callable[[bool], bool] | None = None) -> Decoded:
    """A rollout: each row's tokens drawn by its key (`sampling.keyed_next_tokens`; greedy without do_sample), with
    the log-probs training recomputes (TRL's: the logits divided by the temperature, before top-k and top-p).
    `all_finished(local)`: whether every rank that decodes together has finished (ranks whose forwards are
    collectives across different prompts, expert parallelism's, must stop at the same token)."""
    if keys.dim() != 2 or keys.shape[0] != input_ids.shape[0]:
        raise InvalidValueError(f"a rollout takes one key row per prompt row: keys of shape {tuple(keys.shape)} for "
                                f"{input_ids.shape[0]} prompts")

    def choose(last: torch.Tensor, index: int) -> torch.Tensor:
        if not settings.do_sample:
            return last.float().argmax(dim=-1)
        return keyed_next_tokens(last, keys.to(last.device), index, settings.temperature, settings.top_k,
                                 settings.top_p)

    return _decode(forward, module, input_ids, attention_mask, settings, choose, multiple, all_finished,
                   with_log_probs=True)


def _decode(forward: Forward, module: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            settings: GenerationSettings, choose: Choose, multiple: int,
            all_finished: Callable[[bool], bool] | None = None, with_log_probs: bool = False) -> Decoded:
    documents, positions = prompt_layout(input_ids, attention_mask)
    out, finished = input_ids, torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    eos = torch.tensor(settings.eos_ids, dtype=input_ids.dtype, device=input_ids.device)
    prompt = input_ids.shape[1] + (-input_ids.shape[1] % multiple)
    rows = DecodeRows(documents[:, :0], capacity=prompt + settings.max_new_tokens * multiple)
    chunk = (input_ids, positions, documents)  # what the next forward brings (cached: only the new tokens)
    log_probs: list[torch.Tensor] = []
    with kv_caches(module, rows) if settings.use_cache else nullcontext():
        for index in range(settings.max_new_tokens):
            ids, pos, docs = _pad_to_multiple(*chunk, multiple)
            keep = chunk[0].shape[1] - 1  # the last real token (sequence parallelism may pad after it)
            if settings.use_cache:
                rows.extend(docs)
                last = forward(ids, pos, None, keep)  # the cores read the rows' documents from the cache
                rows.seen += ids.shape[1]
            else:
                last = forward(ids, pos, Documents(docs) if bool((docs == PADDING).any()) else None, keep)
            token = torch.where(finished, settings.pad_id, choose(last, index))
            if with_log_probs:
                scaled = last.float() / settings.temperature
                log_probs.append(scaled.log_softmax(dim=-1).gather(1, token[:, None]).squeeze(1))
            out = torch.cat([out, token[:, None]], dim=1)
            if eos.numel():
                finished |= torch.isin(token, eos)
                done = bool(finished.all())
                if all_finished(done) if all_finished is not None else done:
                    break
            new = (token[:, None], chunk[1][:, -1:] + 1, torch.zeros_like(chunk[2][:, -1:]))
            chunk = new if settings.use_cache else tuple(torch.cat([a, b], 1) for a, b in zip(chunk, new))
    new_log_probs = torch.stack(log_probs, dim=1) if log_probs else out.new_zeros((out.shape[0], 0), dtype=torch.float)
    return Decoded(out, new_log_probs)
