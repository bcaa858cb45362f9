"""Collectives that autograd can differentiate: the transitions into and out of tensor-parallel regions.

Every op takes the `Axis` explicitly and keeps it in the autograd context, so backward communicates on
the same group as forward with no global state (Megatron's `mappings.py`, minus its globals). Each pair
below is one op and its transpose; forward and backward are both counted in the axis' `CommStats` under
the caller's tag (payload: the full tensor for all-reduce, the gathered output for all-gather, the
unreduced input for reduce-scatter).

    op                          forward                      backward
    copy_to_region              identity                     all-reduce
    reduce_from_region          all-reduce                   identity
    gather_from_region          all-gather along `dim`       keep own chunk (no comm)
    scatter_to_region           keep own chunk (no comm)     all-gather along `dim`
    gather_from_sequence        all-gather along `dim`       reduce-scatter along `dim`
    reduce_scatter_to_sequence  reduce-scatter along `dim`   all-gather along `dim`
    exchange_rows               uneven all-to-all of rows    the same all-to-all, counts swapped

On a size-1 axis each op is the identity. A dimension split over the axis must divide by its size; the
error is raised before any collective, identically on every rank (shapes agree across the axis).
"""

from __future__ import annotations

import torch

from paratrain.comm.collectives import all_gather_into, all_reduce, all_to_all_rows, reduce_scatter_into
from paratrain.errors import InvalidValueError
from paratrain.layout.mesh import Axis


def _check_divisible(x: torch.Tensor, dim: int, axis: Axis, what: str) -> None:
    if x.shape[dim] % axis.size:
        raise InvalidValueError(f"{what}: dimension {dim} of a tensor of shape {tuple(x.shape)} has size "
                                f"{x.shape[dim]}, "
                                f"which is not divisible by the {axis.name} size {axis.size}; use sizes that are "
                                f"multiples of {axis.size} (e.g. the sequence length under sequence parallelism)")


def _all_gather(x: torch.Tensor, axis: Axis, dim: int, tag: str) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (axis order)."""
    x = x.contiguous()
    flat = torch.empty(axis.size * x.numel(), dtype=x.dtype, device=x.device)
    all_gather_into(flat, x.view(-1), axis, tag=tag)
    out = flat.view(axis.size, *x.shape)  # (tp, *x.shape)
    if dim == 0:
        return out.view(axis.size * x.shape[0], *x.shape[1:])
    return torch.cat(out.unbind(0), dim=dim)


def _reduce_scatter(x: torch.Tensor, axis: Axis, dim: int, tag: str) -> torch.Tensor:
    """Sum `x` over the axis and keep this rank's chunk along `dim`."""
    chunks = torch.stack(x.chunk(axis.size, dim=dim)) if dim != 0 else x.contiguous()  # (tp, ...) contiguous
    out = torch.empty(x.chunk(axis.size, dim=dim)[0].shape, dtype=x.dtype, device=x.device)
    reduce_scatter_into(out.view(-1), chunks.view(-1), axis, tag=tag)
    return out


def _own_chunk(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    return x.chunk(axis.size, dim=dim)[axis.rank].contiguous()


def _normalize_dim(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, tag):
        ctx.axis, ctx.tag = axis, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone() if not grad.is_contiguous() else grad.clone()
        all_reduce(grad, ctx.axis, tag=ctx.tag)
        return grad, None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, tag):
        out = x.contiguous().clone() if not x.is_contiguous() else x.clone()
        all_reduce(out, axis, tag=tag)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, tag):
        ctx.axis, ctx.dim = axis, dim
        return _all_gather(x, axis, dim, tag)

    @staticmethod
    def backward(ctx, grad):
        return _own_chunk(grad, ctx.axis, ctx.dim), None, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, tag):
        ctx.axis, ctx.dim, ctx.tag = axis, dim, tag
        return _own_chunk(x, axis, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.axis, ctx.dim, ctx.tag), None, None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, tag):
        ctx.axis, ctx.dim, ctx.tag = axis, dim, tag
        return _all_gather(x, axis, dim, tag)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.axis, ctx.dim, ctx.tag), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, tag):
        ctx.axis, ctx.dim, ctx.tag = axis, dim, tag
        return _reduce_scatter(x, axis, dim, tag)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.axis, ctx.dim, ctx.tag), None, None, None


def copy_to_region(x: torch.Tensor, axis: Axis, tag: str = "tp") -> torch.Tensor:
    """Enter a region where every rank uses the same `x` for a different part of the work: the gradients
    each rank computes are partial, so backward sums them over the axis."""
    return x if axis.size == 1 else _CopyToRegion.apply(x, axis, tag)


def reduce_from_region(x: torch.Tensor, axis: Axis, tag: str = "tp") -> torch.Tensor:
    """Leave a region where every rank holds a partial sum: forward sums over the axis (into a new tensor)."""
    return x if axis.size == 1 else _ReduceFromRegion.apply(x, axis, tag)


def gather_from_region(x: torch.Tensor, axis: Axis, dim: int = -1, tag: str = "tp") -> torch.Tensor:
    """Concatenate the ranks' slices of `dim` (e.g. output features of a column-parallel layer)."""
    return x if axis.size == 1 else _GatherFromRegion.apply(x, axis, _normalize_dim(x, dim), tag)


def scatter_to_region(x: torch.Tensor, axis: Axis, dim: int = -1, tag: str = "tp") -> torch.Tensor:
    """Keep this rank's slice of a replicated `x` along `dim`; backward gathers the slices' gradients."""
    if axis.size == 1:
        return x
    dim = _normalize_dim(x, dim)
    _check_divisible(x, dim, axis, "scatter_to_region")
    return _ScatterToRegion.apply(x, axis, dim, tag)


def gather_from_sequence(x: torch.Tensor, axis: Axis, dim: int = 1, tag: str = "tp") -> torch.Tensor:
    """Sequence parallel -> tensor parallel: all-gather the sequence shards; backward reduce-scatters."""
    return x if axis.size == 1 else _GatherFromSequence.apply(x, axis, _normalize_dim(x, dim), tag)


def reduce_scatter_to_sequence(x: torch.Tensor, axis: Axis, dim: int = 1, tag: str = "tp") -> torch.Tensor:
    """Tensor parallel -> sequence parallel: sum the partial results and keep this rank's sequence shard;
    backward all-gathers."""
    if axis.size == 1:
        return x
    dim = _normalize_dim(x, dim)
    _check_divisible(x, dim, axis, "reduce_scatter_to_sequence")
    return _ReduceScatterToSequence.apply(x, axis, dim, tag)


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_rows, recv_rows, axis, tag):
        ctx.counts, ctx.axis, ctx.tag = (send_rows, recv_rows), axis, tag
        x = x.contiguous()
        out = x.new_empty(sum(recv_rows), *x.shape[1:])
        all_to_all_rows(out, x, send_rows, recv_rows, axis, tag=tag)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_rows, recv_rows = ctx.counts
        grad = grad.contiguous()
        out = grad.new_empty(sum(send_rows), *grad.shape[1:])
        all_to_all_rows(out, grad, recv_rows, send_rows, ctx.axis, tag=ctx.tag)
        return out, None, None, None, None


def exchange_rows(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], axis: Axis,
                  tag: str = "ep") -> torch.Tensor:
    """Rows of `x` (dim 0) to the ranks of `axis`, send_rows[j] to rank j (in order); returns the rows received,
    recv_rows[j] from rank j. Backward sends the gradients back the same way (expert parallelism's dispatch
    and combine)."""
    return _ExchangeRows.apply(x, list(send_rows), list(recv_rows), axis, tag)
