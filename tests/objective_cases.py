"""Data and one-process references for the objectives' tests (DPO pairs, GRPO completions).

Preference pairs and completions of different lengths, cut from the embedded corpus and padded to the tiny models'
16 positions by paratrain's collators (TRL's collated forms). The references are written here in plain PyTorch,
independently of `paratrain.objectives`: every row's real tokens run alone through the model (no padding at all),
log-probs from the model's whole-vocabulary logits, and TRL's formulas over the whole global batch.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from paratrain.data import load_corpus
from paratrain.data.preference import CompletionCollator, PreferenceCollator
from paratrain.objectives import Objective, Value
from tests.real_data import documents, logits_of

SEQ = 16
PROMPT, COMPLETION = 8, 8


def _cut(tokens: torch.Tensor, start: int, n: int) -> list[int]:
    return tokens[start:start + n].tolist()


class PreferencePairs(Dataset):
    """`count` pairs: a prompt of 1..7 tokens, a chosen and a rejected completion of 1..(15 - prompt) tokens each;
    with `reference`, each pair carries its precomputed reference sequence log-probs (TRL's ref_chosen_logps,
    ref_rejected_logps)."""

    def __init__(self, count: int = 8, seed: int = 0, reference=None):
        train, _ = load_corpus()
        g = torch.Generator().manual_seed(seed)
        draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
        self.rows = []
        for i in range(count):
            base = i * 64
            p = draw(1, 7)
            self.rows.append({"prompt_ids": _cut(train, base, p),
                              "chosen_ids": _cut(train, base + 16, draw(1, SEQ - p)),
                              "rejected_ids": _cut(train, base + 40, draw(1, SEQ - p))})
        if reference is not None:
            for row in self.rows:
                for side in ("chosen", "rejected"):
                    row[f"ref_{side}_logps"] = float(_completion_log_probs(reference, row["prompt_ids"],
                                                                           row[f"{side}_ids"]).sum())

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


class Completions(Dataset):
    """`count` GRPO rows: a prompt of 1..8 tokens (left-padded), a completion of 1..8 (right-padded), an advantage
    (groups of 4 normalised as TRL does, plus 0.25: a zero mean would make GRPO's first loss 0 exactly, and its
    relative error meaningless), and the initial model's per-token log-probs as the rollout's (`old`)."""

    def __init__(self, model, count: int = 8, seed: int = 1, reference=None):
        train, _ = load_corpus()
        g = torch.Generator().manual_seed(seed)
        draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
        rewards = torch.randn(count, generator=g)
        groups = rewards.view(-1, 4)
        advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1) + 0.25
        self.rows = []
        for i in range(count):
            row = {"prompt_ids": _cut(train, i * 64, draw(1, PROMPT)),
                   "completion_ids": _cut(train, i * 64 + 20, draw(1, COMPLETION)), "advantage": float(advantages[i])}
            row["old_per_token_logps"] = completion_log_probs(model, row).tolist()
            if reference is not None:
                row["ref_per_token_logps"] = completion_log_probs(reference, row).tolist()
            self.rows.append(row)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def preference_collator(pad_to: int = SEQ) -> PreferenceCollator:
    return PreferenceCollator(pad_token_id=0, pad_to=pad_to)


def completion_collator() -> CompletionCollator:
    return CompletionCollator(pad_token_id=0, prompt_len=PROMPT, completion_len=COMPLETION)


@torch.no_grad()
def completion_log_probs(model, row: dict) -> torch.Tensor:
    """The per-token log-probs of a row's completion under `model`, the row's real tokens alone."""
    return _completion_log_probs(model, row["prompt_ids"], row["completion_ids"])


def _completion_log_probs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    logits = logits_of(model, ids)[0].float()  # (len, V)
    scores = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # the positions that predict the completion
    return scores.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def _real(batch_row_ids, mask) -> list[int]:
    return batch_row_ids[mask.bool()].tolist()


def _pair_parts(batch: dict) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen, rejected) token lists of a collated global batch (chosen rows, then rejected)."""
    ids, attention, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    pairs = ids.shape[0] // 2
    out = []
    for i in range(pairs):
        parts = []
        for row in (i, pairs + i):
            real = attention[row].bool()
            prompt = ids[row][real & (completion[row] == 0)].tolist()
            parts.append((prompt, ids[row][real & (completion[row] == 1)].tolist()))
        out.append((parts[0][0], parts[0][1], parts[1][1]))
    return out


def dpo_loss(model, reference, batch: dict, loss_type: str = "sigmoid", beta: float = 0.1,
             label_smoothing: float = 0.0) -> torch.Tensor:
    """TRL's DPO over the whole global batch: sequence log-probs (sums over the completion), per-pair loss, mean."""
    losses = []
    for prompt, chosen, rejected in _pair_parts(batch):
        seq = [_completion_log_probs(model, prompt, c).sum() for c in (chosen, rejected)]
        with torch.no_grad():
            ref = [_completion_log_probs(reference, prompt, c).sum() for c in (chosen, rejected)]
        ratio_c, ratio_r = seq[0] - ref[0], seq[1] - ref[1]
        delta = ratio_c - ratio_r
        if loss_type == "sigmoid":
            losses.append(-F.logsigmoid(beta * delta))
        elif loss_type == "hinge":
            losses.append(torch.relu(1 - beta * delta))
        elif loss_type == "ipo":
            avg = ratio_c / len(chosen) - ratio_r / len(rejected)
            losses.append((avg - 1 / (2 * beta)) ** 2)
        elif loss_type == "robust":
            eps = label_smoothing
            losses.append((-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps))
        else:
            raise ValueError(loss_type)
    return torch.stack(losses).mean()


@torch.no_grad()
def dpo_metrics(model, reference, batch: dict, beta: float = 0.1) -> dict[str, float]:
    """TRL's DPO metrics over the whole global batch: each a mean over its pairs."""
    values = {name: [] for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                                    "logps/chosen", "logps/rejected")}
    for prompt, chosen, rejected in _pair_parts(batch):
        seq = [float(_completion_log_probs(model, prompt, c).sum()) for c in (chosen, rejected)]
        ref = [float(_completion_log_probs(reference, prompt, c).sum()) for c in (chosen, rejected)]
        reward_c, reward_r = beta * (seq[0] - ref[0]), beta * (seq[1] - ref[1])
        for name, value in (("rewards/chosen", reward_c), ("rewards/rejected", reward_r),
                            ("rewards/accuracies", float(reward_c > reward_r)),
                            ("rewards/margins", reward_c - reward_r), ("logps/chosen", seq[0]),
                            ("logps/rejected", seq[1])):
            values[name].append(value)
    return {name: sum(v) / len(v) for name, v in values.items()}


def grpo_loss(model, batch: dict, loss_type: str = "dapo", beta: float = 0.0, epsilon: tuple = (0.2, 0.2),
              max_completion_length: int = COMPLETION, reference=None) -> torch.Tensor:
    """TRL's GRPO policy loss (token-level ratio, two-sided min, k3 KL times the ratio) over the global batch,
    normalised globally by its loss type's count; the reference's log-probs from `reference`, else the batch's."""
    totals, lengths = [], []
    for i in range(batch["prompt_ids"].shape[0]):
        prompt = _real(batch["prompt_ids"][i], batch["prompt_mask"][i])
        n = int(batch["completion_mask"][i].sum())
        completion = batch["completion_ids"][i][:n].tolist()
        logps = _completion_log_probs(model, prompt, completion)
        old = batch["old_per_token_logps"][i][:n].to(logps.dtype)
        advantage = float(batch["advantages"][i])
        ratio = torch.exp(logps - old)
        per_token = -torch.min(ratio * advantage, torch.clamp(ratio, 1 - epsilon[0], 1 + epsilon[1]) * advantage)
        if beta:
            ref = batch["ref_per_token_logps"][i][:n].to(logps.dtype) if reference is None else \
                _completion_log_probs(reference, prompt, completion).detach()
            per_token = per_token + beta * (torch.exp(ref - logps) - (ref - logps) - 1) * ratio
        totals.append(per_token.sum())
        lengths.append(n)
    rows = len(totals)
    if loss_type in ("dapo", "bnpo"):
        return torch.stack(totals).sum() / sum(lengths)
    if loss_type == "grpo":
        return torch.stack([t / n for t, n in zip(totals, lengths)]).mean()
    if loss_type == "dr_grpo":
        return torch.stack(totals).sum() / (rows * max_completion_length)
    raise ValueError(loss_type)


def frozen(model):
    reference = copy.deepcopy(model)
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference.eval()


class SequenceMeanNLL(Objective):
    """A user's own objective, as docs/objectives.md writes one: the mean over rows of each row's mean negative
    log-likelihood of its targets (a per-sequence normaliser, which token means would get wrong under a split)."""

    name = "sequence_mean_nll"

    def __call__(self, batch, lp) -> Value:
        per_row = -lp.row_sum() / lp.row_count().clamp(min=1).to(lp.values.dtype)  # whole rows, in any split
        rows = (lp.row_count() > 0).double()
        return Value(lp.once((per_row * rows).sum()), lp.once(rows.sum()))


def sequence_mean_nll(model, batch: dict) -> torch.Tensor:
    """The reference of `SequenceMeanNLL`: each row's real tokens alone (one document per row here)."""
    means = []
    for i in range(batch["input_ids"].shape[0]):
        row = {k: v[i] for k, v in batch.items()}
        for ids, labels in documents(row):
            targets = F.pad(labels[1:], (0, 1), value=-100)
            if (targets != -100).any():
                logits = logits_of(model, ids.unsqueeze(0))[0]
                means.append(F.cross_entropy(logits.float(), targets, reduction="sum") / (targets != -100).sum())
    return torch.stack(means).mean()
