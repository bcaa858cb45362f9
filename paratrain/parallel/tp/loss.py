"""Cross-entropy over logits whose vocabulary is split across tp: the full logits never exist on one rank.

For every token, with z the logits and t the target (Megatron's vocab-parallel cross-entropy):

    m   = max_v z_v                  all-reduce MAX of one scalar per token
    S   = sum_v exp(z_v - m)         } one all-reduce SUM of two scalars per token
    z_t - m  (0 on ranks without t)  }
    loss = log S - (z_t - m)         identical on every tp rank
    d loss / d z_v = softmax_v - [v == t]   computed locally from the saved exp(z - m) / S

Subtracting the global max keeps exp() in range (numerically stable); padded vocabulary columns (an
uneven vocabulary) are set to -inf so they take no probability. The mean is over tokens whose target is
not `ignore_index`, as `F.cross_entropy` does (0, not NaN, when there is none).
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.comm import all_reduce
from paratrain.layout.mesh import Axis
from paratrain.parallel.tp.layers import PlanError

LOSS_TAG = "tp_loss"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, axis: Axis, vocab_start: int, vocab_size: int, ignore_index: int):
        x = logits.float()  # (N, V/tp)
        local = x.shape[-1]
        if vocab_start + local > vocab_size:  # this rank holds padding columns of an uneven vocabulary
            x = x.masked_fill(torch.arange(vocab_start, vocab_start + local, device=x.device) >= vocab_size,
                              float("-inf"))
        token_max = x.max(dim=-1).values  # (N,)
        all_reduce(token_max, axis, op="max", tag=LOSS_TAG)
        shifted = x - token_max.unsqueeze(-1)  # (N, V/tp), a new tensor
        in_range = (targets >= vocab_start) & (targets < vocab_start + local)
        local_targets = (targets - vocab_start).masked_fill(~in_range, 0)
        target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        exp = shifted.exp_()
        sums = torch.stack([exp.sum(dim=-1), target_logit])  # (2, N): one message for both sums
        all_reduce(sums, axis, tag=LOSS_TAG)
        sum_exp, target_logit = sums[0], sums[1]
        valid = targets != ignore_index
        count = valid.sum().clamp(min=1)  # no target at all (a chunk of prompt or padding): loss 0, not NaN
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0).sum() / count
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_targets, in_range & valid, valid, count)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_targets, hit, valid, count = ctx.saved_tensors
        g = softmax.clone()  # the saved softmax stays intact (backward may run twice with retain_graph)
        g.scatter_add_(-1, local_targets.unsqueeze(-1), -hit.to(g.dtype).unsqueeze(-1))
        g.mul_((valid.to(g.dtype) * (grad / count)).unsqueeze(-1))
        return g.to(ctx.logits_dtype), None, None, None, None, None


class _VocabParallelLogProbs(torch.autograd.Function):
    """Per-token log-probabilities of the targets, log p_t = (z_t - m) - log S, and (no gradient) the entropy
    H = log S - sum_v p_v (z_v - m): the same two all-reduces as the cross-entropy, a third sum in the second
    message when the entropy is asked for. IGNORE targets give 0."""

    @staticmethod
    def forward(ctx, logits, targets, axis: Axis, vocab_start: int, vocab_size: int, ignore_index: int,
                with_entropy: bool):
        x = logits.float()  # (N, V/tp)
        local = x.shape[-1]
        padded = vocab_start + local > vocab_size
        if padded:  # this rank holds padding columns of an uneven vocabulary
            x = x.masked_fill(torch.arange(vocab_start, vocab_start + local, device=x.device) >= vocab_size,
                              float("-inf"))
        token_max = x.max(dim=-1).values  # (N,)
        all_reduce(token_max, axis, op="max", tag=LOSS_TAG)
        shifted = x - token_max.unsqueeze(-1)
        in_range = (targets >= vocab_start) & (targets < vocab_start + local)
        local_targets = (targets - vocab_start).masked_fill(~in_range, 0)
        target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        exp = shifted.exp()
        parts = [exp.sum(dim=-1), target_logit]
        if with_entropy:  # sum_v exp(z_v - m) (z_v - m); padding columns are exp 0 times -inf: kept out
            parts.append((exp * shifted.masked_fill(exp == 0, 0.0)).sum(dim=-1))
        sums = torch.stack(parts)  # (2 or 3, N): one message
        all_reduce(sums, axis, tag=LOSS_TAG)
        log_sum = sums[0].log()
        valid = targets != ignore_index
        logps = (sums[1] - log_sum).masked_fill(~valid, 0.0)
        entropy = (log_sum - sums[2] / sums[0]) if with_entropy else torch.zeros_like(logps)
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), local_targets, in_range & valid, valid)
        ctx.logits_dtype = logits.dtype
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad, _grad_entropy):
        softmax, local_targets, hit, valid = ctx.saved_tensors
        g = softmax.neg()  # d log p_t / d z_v = [v == t] - softmax_v
        g.scatter_add_(-1, local_targets.unsqueeze(-1), hit.to(g.dtype).unsqueeze(-1))
        g.mul_((valid.to(g.dtype) * grad).unsqueeze(-1))
        return g.to(ctx.logits_dtype), None, None, None, None, None, None


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, axis: Axis, vocab_start: int,
                             vocab_size: int, ignore_index: int = -100, with_entropy: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each target, entropy of each position) shaped like `targets`; logits (..., V/tp) hold
    vocabulary ids [vocab_start, vocab_start + V/tp). The full logits never exist on one rank."""
    local = logits.shape[-1]
    logps, entropy = _VocabParallelLogProbs.apply(logits.reshape(-1, local), targets.reshape(-1), axis, vocab_start,
                                                  vocab_size, ignore_index, with_entropy)
    return logps.view(targets.shape), entropy.view(targets.shape)


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, axis: Axis, vocab_start: int,
                                 vocab_size: int, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy; logits (..., V/tp) hold vocabulary ids [vocab_start, vocab_start + V/tp)."""
    local = logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits.reshape(-1, local), targets.reshape(-1), axis, vocab_start,
                                            vocab_size, ignore_index)


class VocabParallelCrossEntropy(nn.Module):
    """Drop-in for a `loss(logits, targets)` module when the logits come from a vocab-split head."""

    def __init__(self, axis: Axis, vocab_size: int, vocab_start: int, local_vocab: int, ignore_index: int = -100,
                 name: str = ""):
        super().__init__()
        self.axis, self.vocab_size, self.vocab_start = axis, vocab_size, vocab_start
        self.local_vocab, self.ignore_index, self.name = local_vocab, ignore_index, name

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] != self.local_vocab:
            raise PlanError(f"'{self.name}' (vocab_loss) expected logits with this rank's {self.local_vocab} "
                            f"vocabulary entries in the last dimension, got shape {tuple(logits.shape)}: feed it "
                            f"the output of the 'colwise_vocab' head directly")
        return vocab_parallel_cross_entropy(logits, targets, self.axis, self.vocab_start, self.vocab_size,
                                            self.ignore_index)

    def log_probs(self, logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (log-probabilities of the targets, entropies), exact over the split vocabulary."""
        return vocab_parallel_log_probs(logits, targets, self.axis, self.vocab_start, self.vocab_size,
                                        self.ignore_index, with_entropy)

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, local=[{self.vocab_start}, {self.vocab_start + self.local_vocab}), "
                f"tp={self.axis.size}")
