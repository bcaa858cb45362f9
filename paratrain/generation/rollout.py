"""A rollout batch in TRL's completion form: what GRPO trains on, with the log-probs the sampler used.

`completion_mask` is TRL's: 1 for every generated token up to and including the first end-of-sequence token, 0
after it. `log_probs` are the generated tokens' log-probs under the logits divided by the temperature (TRL's
`old_per_token_logps`), 0 where the mask is 0; training recomputes the same numbers for the same tokens
(docs/objectives.md, "Rollouts").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.errors import InvalidValueError
from paratrain.generation.loop import Decoded


@dataclass
class Rollout:
    completion_ids: torch.Tensor  # (b, n) the generated tokens, pad_token_id after a row's end
    completion_mask: torch.Tensor  # (b, n) int64: 1 up to and including the first eos
    log_probs: torch.Tensor  # (b, n) fp32 log p(token) under logits / temperature; 0 outside the mask

    @classmethod
    def of(cls, decoded: Decoded, prompt_length: int, eos_ids: list[int]) -> Rollout:
        completion = decoded.ids[:, prompt_length:]
        mask = torch.ones_like(completion)
        if eos_ids:
            is_eos = torch.isin(completion, torch.tensor(eos_ids, dtype=completion.dtype, device=completion.device))
            after = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # positions after the first eos
            mask = (~after).long()
        return cls(completion, mask, decoded.log_probs * mask)

    def padded(self, length: int) -> Rollout:
        """The completions padded on the right to `length` columns (masked out): a batch of rollouts from ranks
        that stopped at different lengths, or a length sequence parallelism divides."""
        extra = length - self.completion_ids.shape[1]
        if extra < 0:
            raise InvalidValueError(f"Rollout.padded({length}): the completions already have "
                                    f"{self.completion_ids.shape[1]} columns; pad to at least that many")
        pad = lambda t: torch.nn.functional.pad(t, (0, extra))  # noqa: E731
        return Rollout(pad(self.completion_ids), pad(self.completion_mask), pad(self.log_probs))

    def to_batch(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, advantages: torch.Tensor) -> dict:
        """The GRPO micro-batch of these completions (TRL's collated form; `old_per_token_logps` the rollout's)."""
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": self.completion_ids,
                "completion_mask": self.completion_mask, "advantages": advantages,
                "old_per_token_logps": self.log_probs}


def rollout_keys(seed: int, step: int, prompt_index: torch.Tensor, generation_index: torch.Tensor) -> torch.Tensor:
    """(b, 4) keys of rows (seed, step, global prompt index, generation index): what a row's sampling depends on,
    whichever rank holds it (`sampling.keyed_uniform`)."""
    prompt_index, generation_index = torch.as_tensor(prompt_index).long(), torch.as_tensor(generation_index).long()
    b = prompt_index.shape[0]
    return torch.stack([torch.full((b,), seed, dtype=torch.long), torch.full((b,), step, dtype=torch.long),
                        prompt_index, generation_index], dim=1)
