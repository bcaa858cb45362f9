"""TRL's collated micro-batches of preference pairs and of GRPO completions, in paratrain's normal form.

    preference  {"input_ids", "attention_mask", "completion_mask"[, "ref_chosen_logps", "ref_rejected_logps"]}
                (b = 2 · pairs rows: the chosen completions, then the rejected ones, as
                `trl.trainer.dpo_trainer.DataCollatorForPreference` builds them)
    completions {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages"
                 [, "old_per_token_logps", "ref_per_token_logps"]}  (GRPOTrainer's inputs: prompts left-padded)

[Note: what the normal form keeps of them]
The targets are the completion tokens, shifted once as every token micro-batch's are: a position predicts the
next token, and only a completion token is a target, so the sum of a row's per-target log-probs is TRL's
sequence log-prob. Per-row values (advantages, precomputed reference sequence log-probs, as one (b,) tensor in
the row order) ride in `rows`, which no split cuts; per-completion-token values (old and reference per-token
log-probs, (b, completion length)) are moved to the positions that predict those tokens, in `tokens` (b, s),
which the context-parallel split cuts like the targets. Positions and padding come from the attention mask, as
generation places them (`token_layout.with_layout`), so training scores a completion exactly where it was sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.data.token_layout import IGNORE, MicroBatchError, describe, is_token_tensor

PREFERENCE_KEYS = frozenset({"input_ids", "attention_mask", "completion_mask", "ref_chosen_logps",
                             "ref_rejected_logps"})
COMPLETION_KEYS = frozenset({"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                             "old_per_token_logps", "ref_per_token_logps"})


@dataclass
class ObjectiveParts:
    input_ids: torch.Tensor  # (b, s)
    targets: torch.Tensor  # (b, s), IGNORE outside the completions
    attention_mask: torch.Tensor  # (b, s), for the layout
    rows: dict[str, torch.Tensor]
    tokens: dict[str, torch.Tensor]
    form: str


def objective_form(kwargs: dict) -> str | None:
    """"preference" or "completions" when a dict micro-batch is one of TRL's collated forms, else None."""
    if "completion_mask" not in kwargs:
        return None
    form, known = ("completions", COMPLETION_KEYS) if "completion_ids" in kwargs else ("preference", PREFERENCE_KEYS)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise MicroBatchError(f"a {form} micro-batch (TRL's collated form) takes {sorted(known)}; got also "
                              f"{unknown}: drop them in the collator")
    return form


def objective_parts(kwargs: dict) -> ObjectiveParts:
    return _preference(kwargs) if objective_form(kwargs) == "preference" else _completions(kwargs)


def _preference(kwargs: dict) -> ObjectiveParts:
    ids = _tokens(kwargs, "input_ids")
    mask = _mask(kwargs, "completion_mask", ids.shape)
    attention = _mask(kwargs, "attention_mask", ids.shape) if "attention_mask" in kwargs else torch.ones_like(mask)
    if ids.shape[0] % 2:
        raise MicroBatchError(f"a preference micro-batch holds the chosen rows, then the rejected rows of the same "
                              f"pairs, so an even number of rows; got {ids.shape[0]}: collate pairs with TRL's "
                              f"DataCollatorForPreference (or paratrain's data.format \"preference\")")
    rows = {}
    given = [k for k in ("ref_chosen_logps", "ref_rejected_logps") if k in kwargs]
    if len(given) == 1:
        raise MicroBatchError(f"a preference micro-batch has {given[0]} without its partner: give both "
                              f"ref_chosen_logps and ref_rejected_logps (precompute_ref_log_probs), or neither")
    if given:
        pairs = ids.shape[0] // 2
        for key in given:
            value = kwargs[key]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != (pairs,):
                raise MicroBatchError(f"`{key}` must be a ({pairs},) tensor, one value per pair, got "
                                      f"{describe(value)}")
        rows["ref_logps"] = torch.cat([kwargs["ref_chosen_logps"], kwargs["ref_rejected_logps"]]).double()
    return ObjectiveParts(ids, _shifted_targets(ids, mask.bool()), attention, rows, {}, "preference")


def _completions(kwargs: dict) -> ObjectiveParts:
    prompt, completion = _tokens(kwargs, "prompt_ids"), _tokens(kwargs, "completion_ids")
    if prompt.shape[0] != completion.shape[0]:
        raise MicroBatchError(f"prompt_ids has {prompt.shape[0]} rows and completion_ids {completion.shape[0]}: "
                              f"one completion per row")
    b, p = prompt.shape
    c = completion.shape[1]
    if p == 0:
        raise MicroBatchError("`prompt_ids` is empty: a completion's first token is scored by the position before "
                              "it, so every row needs a prompt (at least a BOS token)")
    ids = torch.cat([prompt, completion], dim=1)
    completion_mask = _mask(kwargs, "completion_mask", completion.shape)
    prompt_mask = _mask(kwargs, "prompt_mask", prompt.shape) if "prompt_mask" in kwargs else \
        torch.ones_like(prompt)
    scored = torch.cat([torch.zeros_like(prompt_mask), completion_mask], dim=1).bool()
    advantages = kwargs.get("advantages")
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) != (b,):
        raise MicroBatchError(f"`advantages` must be a ({b},) tensor (one per completion), got {describe(advantages)}")
    tokens = {}
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        if key in kwargs:
            value = kwargs[key]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != (b, c):
                raise MicroBatchError(f"`{key}` must be a ({b}, {c}) tensor shaped like completion_ids, got "
                                      f"{describe(value)}")
            tokens[key] = _at_predicting_positions(value, p)
    return ObjectiveParts(ids, _shifted_targets(ids, scored), torch.cat([prompt_mask, completion_mask], dim=1),
                          {"advantages": advantages}, tokens, "completions")


def _shifted_targets(ids: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t + 1, a target only where that token is scored (a completion token)."""
    targets = torch.full_like(ids, IGNORE)
    targets[:, :-1] = ids[:, 1:].masked_fill(~scored[:, 1:], IGNORE)
    return targets


def _at_predicting_positions(values: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """(b, c) values of the completion tokens -> (b, p + c) at the positions that predict them (p - 1 + j)."""
    b, c = values.shape
    out = torch.zeros(b, prompt_len + c, dtype=torch.float64, device=values.device)
    out[:, prompt_len - 1:prompt_len - 1 + c] = values
    return out


def _tokens(kwargs: dict, key: str) -> torch.Tensor:
    value = kwargs.get(key)
    if not is_token_tensor(value):
        raise MicroBatchError(f"`{key}` must be a (b, s) integer tensor of token ids, got {describe(value)}")
    return value


def _mask(kwargs: dict, key: str, shape) -> torch.Tensor:
    value = kwargs.get(key)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
        raise MicroBatchError(f"`{key}` must be a 0/1 tensor of shape {tuple(shape)}, got {describe(value)}")
    return value.long()
