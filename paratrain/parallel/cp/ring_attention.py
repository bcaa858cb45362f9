"""Ring attention: exact causal attention over a sequence split across the cp axis.

Each cp rank holds the queries, keys and values of its two mirrored chunks (see `sharding.py`). K/V blocks
travel once around the ring: at step i rank r works on the block of rank (r − i) mod cp while the next
block is already in flight (`paratrain.comm.send_recv`, to r + 1, from r − 1), so the exchange overlaps the
block's matrix products. Partial results are merged with the online softmax: each block gives its output
normalized within the block plus the log-sum-exp of its scores, and two partial results combine as

    lse = logaddexp(lse_a, lse_b),   out = out_a · exp(lse_a − lse) + out_b · exp(lse_b − lse).

[Note: which part of a block is computed]
With the mirrored chunks, causality decides the work per block with no element-wise mask except on the
diagonal (rank r holds chunks r and 2cp−1−r; rank j's block holds chunks j and 2cp−1−j):
  j == r   the rank's own block: causal over its local tokens (they are in increasing position order)
  j <  r   every local query sees the block's head chunk; its tail chunk lies in the future of all of them
  j >  r   only the local tail-chunk queries see the block, and they see all of it
The skipped halves are the fully masked blocks; every rank does the same work at every step.

[Note: the exact backward]
Backward recomputes each block's probabilities from the saved final log-sum-exp (P = exp(S − lse)), so
they are the true, globally normalized probabilities, and uses D = rowsum(dO ∘ O) for the softmax
gradient: dS = P ∘ (dO Vᵀ − D). dQ accumulates locally. K and V travel around the ring again, and the
gradient of each block travels with it: the accumulator for rank j's block starts at rank j + 1, collects
every other rank's contribution and arrives back at rank j after cp − 1 hops, where j's own (diagonal)
contribution is added. Per layer and micro-batch each rank therefore sends (and receives) cp − 1 K blocks
and cp − 1 V blocks forward, and cp − 1 each of K, V, dK, dV backward. In backward an accumulator exchange
and the next K/V exchange are in flight to the same neighbour at once; point-to-point messages between two
ranks are matched in the order they are posted, and every rank posts them in the same order.

The attention of one block pair and its backward are `blocks.py` (torch's fused CPU flash kernels, or
plain matmuls). With packed documents, padding or a sliding window, each part also gets its element-wise mask
and an empty part is skipped (`ring_masks.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.attention import Documents, check_window, expand_kv_heads, masked_attention
from paratrain.comm import Handle, send_recv
from paratrain.errors import InvalidValueError
from paratrain.layout.mesh import Axis
from paratrain.parallel.cp import blocks
from paratrain.parallel.cp.ring_masks import PairCounts, RingMasks

KV_TAG = "cp"  # K and V blocks, forward and backward
GRAD_TAG = "cp_grad"  # the dK, dV accumulators travelling back to their owners


def _exchange(tensors: list[torch.Tensor], axis: Axis, tag: str) -> tuple[list[torch.Tensor], list[Handle]]:
    """Send `tensors` to the next cp rank and receive the same shapes from the previous one (async)."""
    nxt, prev = (axis.rank + 1) % axis.size, (axis.rank - 1) % axis.size
    tensors = [t.contiguous() for t in tensors]  # a fused kernel's gradients may come in another layout
    received = [torch.empty_like(t) for t in tensors]
    handles = send_recv([(t, nxt) for t in tensors], [(t, prev) for t in received], axis, tag=tag)
    return received, handles


def _wait(handles: list[Handle]) -> None:
    for handle in handles:
        handle.wait()


def _merge(out, lse, block_out, block_lse) -> None:
    """Fold one block's (output, log-sum-exp) into the running ones, in place."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _part(masks: RingMasks | None, block: int, counts: PairCounts | None):
    """(compute it?, its mask) for this rank's part of `block` (None: causality alone decides)."""
    if masks is None:
        return True, None
    mask = masks.part(block)
    if counts is not None:
        counts.computed += mask is not None
        counts.skipped += mask is None
    return mask is not None, mask


def _ring_forward(q, k, v, axis: Axis, scale: float, block_forward, masks: RingMasks | None = None,
                  counts: PairCounts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r, c, half = axis.rank, axis.size, q.shape[-2] // 2
    kv, in_flight = _exchange([k, v], axis, KV_TAG)  # the first block travels while the own block computes
    _, own = _part(masks, r, counts)  # never empty: every query attends at least itself
    out, lse = block_forward(q, k, v, scale, own is None, own)  # (b, h, s/cp, d), (b, h, s/cp)
    for step in range(1, c):
        _wait(in_flight)
        block_k, block_v = kv
        if step < c - 1:  # pass this block on while working on it
            kv, in_flight = _exchange([block_k, block_v], axis, KV_TAG)
        block = (r - step) % c
        compute, mask = _part(masks, block, counts)
        if not compute:
            continue
        if block < r:  # all queries, the block's head chunk
            _merge(out, lse, *block_forward(q, block_k[..., :half, :], block_v[..., :half, :], scale, False, mask))
        else:  # the tail-chunk queries, the whole block
            _merge(out[..., half:, :], lse[..., half:], *block_forward(q[..., half:, :], block_k, block_v,
                                                                       scale, False, mask))
    return out, lse


def _ring_backward(do, q, k, v, out, lse, axis: Axis, scale: float, block_backward, masks: RingMasks | None = None):
    r, c, half = axis.rank, axis.size, q.shape[-2] // 2
    kv, in_flight = _exchange([k, v], axis, KV_TAG)
    _, own = _part(masks, r, None)
    dq, dk_own, dv_own = block_backward(do, q, k, v, out, lse, scale, own is None, own)
    tail = (do[..., half:, :], q[..., half:, :])  # the tail-chunk query rows
    grads, grads_in_flight = None, []
    for step in range(1, c):
        _wait(in_flight)
        block_k, block_v = kv
        if step < c - 1:
            kv, in_flight = _exchange([block_k, block_v], axis, KV_TAG)
        block = (r - step) % c
        compute, mask = _part(masks, block, None)
        if not compute:  # the forward skipped it: no gradient from this rank, the accumulator still travels
            dk, dv = torch.zeros_like(block_k), torch.zeros_like(block_v)
        elif block < r:
            dq_part, dk_head, dv_head = block_backward(do, q, block_k[..., :half, :], block_v[..., :half, :], out,
                                                       lse, scale, False, mask)
            dq += dq_part
            dk, dv = torch.zeros_like(block_k), torch.zeros_like(block_v)
            dk[..., :half, :], dv[..., :half, :] = dk_head, dv_head
        else:
            dq_part, dk, dv = block_backward(*tail, block_k, block_v, out[..., half:, :], lse[..., half:], scale,
                                             False, mask)
            dq[..., half:, :] += dq_part
        if grads is not None:  # what the ranks before this one added to this block's gradient
            _wait(grads_in_flight)
            dk += grads[0]
            dv += grads[1]
        grads, grads_in_flight = _exchange([dk, dv], axis, GRAD_TAG)  # on towards the block's owner
    if grads is not None:  # this rank's own block, back from its trip around the ring
        _wait(grads_in_flight)
        dk_own += grads[0]
        dv_own += grads[1]
    return dq, dk_own, dv_own


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, axis: Axis, scale: float, kernel: str, masks: RingMasks | None,
                counts: PairCounts | None):
        # At least fp32 math and accumulators (bf16/fp16 inputs are promoted; fp64 stays fp64).
        math_dtype = torch.promote_types(q.dtype, torch.float32)
        qm, km, vm = (t.to(math_dtype).contiguous() for t in (q, k, v))  # (b, h, s/cp, d)
        block_forward, ctx.block_backward = blocks.pick(kernel, q.device)
        out, lse = _ring_forward(qm, km, vm, axis, scale, block_forward, masks, counts)
        ctx.save_for_backward(qm, km, vm, out, lse)
        ctx.axis, ctx.scale, ctx.dtypes, ctx.masks = axis, scale, (q.dtype, k.dtype, v.dtype), masks
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _ring_backward(grad.to(q.dtype).contiguous(), q, k, v, out, lse, ctx.axis, ctx.scale,
                               ctx.block_backward, ctx.masks)
        return (*(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)), None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: Axis,
                   scale: float | None = None, kernel: str = "auto", documents: Documents | None = None,
                   window: int | None = None, counts: PairCounts | None = None) -> torch.Tensor:
    """Causal softmax(q kᵀ · scale) v over the whole sequence, for this rank's chunks (see `sharding.py`).

    q, k, v, output: (b, heads, s/cp, head_dim), the local tokens in `split_sequence` order; `scale`
    defaults to 1/sqrt(head_dim) as in `F.scaled_dot_product_attention`; `kernel` is the per-block
    attention (`blocks.py`: auto, flash_cpu, math). `documents` (whole rows) and `window` restrict which
    pairs attend (`paratrain.attention`); `counts` records the block parts computed and skipped.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    window = check_window(window)
    if q.shape[-2] % 2 or q.shape != k.shape or k.shape != v.shape:
        raise InvalidValueError(f"ring attention on {axis.name}: q, k, v must have one shape (b, h, s/cp, d) with an "
                                f"even "
                                f"local length (two chunks); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    half = q.shape[-2] // 2
    if window is not None and window >= 2 * axis.size * half:
        window = None  # no shorter than the row: masks nothing
    masks = None
    if documents is not None or window is not None:
        if documents is not None and documents.length != 2 * axis.size * half:
            raise InvalidValueError(f"ring attention over {axis.size} ranks of {2 * half} tokens got document ids "
                                    f"for rows of {documents.length}")
        masks = RingMasks(documents, window, axis.size, axis.rank, half, q.device)
    if axis.size == 1:
        return masked_attention(q, k, v, documents, window, scale=scale)
    return _RingAttention.apply(q, k, v, axis, scale, kernel, masks, counts)


class RingAttentionCore(nn.Module):
    """Drop-in replacement for `CausalAttentionCore` under context parallelism (grouped-query attention too).
    `pairs` counts the block parts its forwards computed and skipped (nothing to attend in them)."""

    def __init__(self, axis: Axis):
        super().__init__()
        self.axis = axis
        self.pairs = PairCounts()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None,
                window: int | None = None) -> torch.Tensor:
        # Grouped-query attention: k/v heads repeated to q's before the ring (the blocks sent are q-sized).
        k, v = expand_kv_heads(k, v, q.shape[1])
        return ring_attention(q, k, v, self.axis, documents=documents, window=window, counts=self.pairs)

    def extra_repr(self) -> str:
        return f"axis={self.axis.name}, size={self.axis.size}"
