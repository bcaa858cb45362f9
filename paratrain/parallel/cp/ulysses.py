"""Ulysses sequence parallelism: an all-to-all turns this rank's tokens of every head into every token of
this rank's heads, attention runs locally on whole sequences, and a second all-to-all turns it back.

    core = UlyssesAttentionCore(axis)                    # Ulysses over cp: plain causal attention inside
    core = UlyssesAttentionCore(ulysses_axis, RingAttentionCore(ring_axis))   # USP: ring attention inside

q, k, v and the output are (b, heads, s_local, head_dim) outside and (b, heads/u, u·s_local, head_dim)
inside, where u is the axis size; heads are the tensor-parallel rank's heads, which u must divide. Grouped-
query attention sends k and v with their own (fewer) heads when u divides them too, and repeats them to
q's heads first when it does not.

[Note: what crosses the axis]
Per layer and micro-batch each of the four all-to-alls (q, k, v in; the output back) sends (u − 1)/u of a
(b, heads, s_local, head_dim) tensor: 4 · (b·s·h/cp) · (cp − 1)/cp elements forward under pure Ulysses
(s_local = s/cp, h the local hidden width), k and v smaller by n_kv_head/n_head with grouped-query attention,
and the same again in backward (the transposes). Counted under the tag "ulysses".

[Note: which tokens a rank holds]
The all-to-all concatenates the ranks' tokens in axis order, so the inside sees the sequence that the ranks'
pieces make in that order. Pure Ulysses splits the sequence into cp contiguous pieces (every rank computes
all tokens of its heads, so the causal mask costs every rank the same); under USP the pieces of one ring
rank are its two mirrored chunks cut into u contiguous parts, and the inside is that ring rank's local
sequence, which ring attention expects (`sharding.SequenceSplit`).
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.attention import Documents, expand_kv_heads, masked_attention
from paratrain.comm import all_to_all_into
from paratrain.errors import InvalidValueError
from paratrain.layout.mesh import Axis

TAG = "ulysses"


def _seq_to_heads(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """(b, h, s, d) this rank's tokens of all heads -> (b, h/u, u·s, d) all tokens of this rank's heads."""
    b, h, s, d = x.shape
    u = axis.size
    send = x.reshape(b, u, h // u, s, d).transpose(0, 1).contiguous()  # (u, b, h/u, s, d): head group j -> j
    recv = torch.empty_like(send)
    all_to_all_into(recv, send, axis, tag=TAG)  # recv[j]: rank j's tokens of this rank's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // u, u * s, d)


def _heads_to_seq(y: torch.Tensor, axis: Axis) -> torch.Tensor:
    """The inverse: (b, h/u, u·s, d) -> (b, h, s, d)."""
    b, hu, total, d = y.shape
    u = axis.size
    send = y.reshape(b, hu, u, total // u, d).permute(2, 0, 1, 3, 4).contiguous()  # (u, b, h/u, s, d): tokens -> j
    recv = torch.empty_like(send)
    all_to_all_into(recv, send, axis, tag=TAG)  # recv[j]: this rank's tokens of rank j's heads
    return recv.transpose(0, 1).reshape(b, u * hu, total // u, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return _seq_to_heads(x, axis)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _heads_to_seq(grad.contiguous(), ctx.axis), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return _heads_to_seq(y, axis)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_to_heads(grad.contiguous(), ctx.axis), None


def check_heads(heads: int, size: int, what: str = "attention") -> None:
    """Refuse, naming the sizes that would work, a head count that `size` ranks cannot split."""
    if heads % size:
        works = [u for u in range(1, heads + 1) if heads % u == 0]
        raise InvalidValueError(f"Ulysses over {size} ranks splits the {heads} {what} heads of each rank (after "
                                f"tensor parallelism) into {size} groups, which does not divide them; use a "
                                f"context_parallel ulysses size in {works}, or method 'ring'")


class UlyssesAttentionCore(nn.Module):
    """Drop-in replacement for `CausalAttentionCore`: all-to-all, `inner` attention (causal SDPA by default),
    all-to-all back."""

    def __init__(self, axis: Axis, inner: nn.Module | None = None):
        super().__init__()
        self.axis = axis
        self.inner = inner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None,
                window: int | None = None) -> torch.Tensor:
        """`documents` (whole rows) and `window` (`paratrain.attention`): pure Ulysses sees the whole row inside,
        in order, so the plain masked attention applies; under USP the inner ring attention cuts its own."""
        u = self.axis.size
        check_heads(q.shape[1], u)
        if k.shape[1] % u:  # fewer k/v heads than groups: each group gets its own copies
            k, v = expand_kv_heads(k, v, q.shape[1])
        q, k, v = (_SeqToHeads.apply(t.contiguous(), self.axis) for t in (q, k, v))  # (b, h/u, u·s, d)
        if self.inner is not None:
            out = self.inner(q, k, v) if documents is None and window is None else \
                self.inner(q, k, v, documents, window)
        else:
            k, v = expand_kv_heads(k, v, q.shape[1])
            out = masked_attention(q, k, v, documents, window)
        return _HeadsToSeq.apply(out.contiguous(), self.axis)

    def extra_repr(self) -> str:
        return f"axis={self.axis.name}, size={self.axis.size}, inner={'sdpa' if self.inner is None else 'ring'}"
