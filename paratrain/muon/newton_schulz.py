"""Muon's arithmetic, written to give the same bits as `torch.optim.Muon` on the same matrix.

A parameter Muon takes is one matrix (rows, columns), or a stack of them (an MoE layer's experts, (E, rows,
columns)): every leading dimension indexes separate matrices, each orthogonalized and lr-scaled on its own
(torch's Muon refuses anything but 2-d; `tests/unit/test_muon.py` checks a stack against torch's Muon run on
each matrix as its own parameter).
"""

from __future__ import annotations

import math

import torch

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def newton_schulz(matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The quintic Newton-Schulz approximation of U V^T for one 2-d `matrix` (U S V^T its SVD), in `dtype`
    (torch's Muon: bfloat16): the same operations in the same order as torch, so a rank orthogonalizing a
    gathered matrix gets what one process does.

    [Note: why float32 exists] In bfloat16 the result is exact only for bit-identical input: an input element one
    float32 rounding away (a data-parallel sum in another order) can round to the other bfloat16 neighbour, and
    five iterations spread that over the matrix (measured: 0.2% of an update's norm after one step, 2.4% of a
    weight's after four). `ns_dtype: "float32"` makes every layout agree with one process to float32 rounding."""
    a, b, c = coefficients
    x = matrix.to(dtype, copy=True)  # normalized in place below: never the caller's tensor
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def orthogonalize(tensor: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`newton_schulz` of every matrix in `tensor` (its last two dimensions), returned in `tensor`'s dtype."""
    if tensor.dim() == 2:
        return newton_schulz(tensor, coefficients, steps, eps, dtype).to(tensor.dtype)
    flat = tensor.reshape(-1, *tensor.shape[-2:])
    out = torch.stack([newton_schulz(m, coefficients, steps, eps, dtype) for m in flat])
    return out.to(tensor.dtype).view(tensor.shape)


def muon_shape_problem(shape: tuple[int, ...], expert_stack: bool) -> str | None:
    """Why a tensor of `shape` cannot be Muon's (None: it can): a matrix, or an expert layer's (E, rows, columns)
    stack of matrices. A convolution's 4-d weight is neither (torch's Muon refuses it too)."""
    if len(shape) == 2 or (len(shape) == 3 and expert_stack):
        return None
    return f"shape {tuple(shape)}: Muon takes 2-d matrices, or an expert layer's (E, rows, columns) stack of them"


def lr_ratio(shape: tuple[int, ...], adjust_lr_fn: str | None) -> float:
    """torch's shape adjustment of the learning rate, of one matrix (the last two dimensions of `shape`):
    "original" (and None) sqrt(max(1, rows / columns)), "match_rms_adamw" 0.2 sqrt(max(rows, columns))."""
    rows, columns = shape[-2], shape[-1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / columns))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, columns))
    return 1.0


def ns_flops(shape: tuple[int, ...], steps: int) -> int:
    """Multiply-adds x 2 of `newton_schulz` on one (rows, columns) matrix: per step X X^T (2 m^2 n), the
    Gram's square (2 m^3) and its product with X (2 m^2 n), m the smaller side. The balance of the owners'
    work is counted in these."""
    m, n = sorted(shape[-2:])
    return steps * (4 * m * m * n + 2 * m ** 3)


def momentum_update(grad: torch.Tensor, buffer: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """torch's Muon momentum, element-wise (so it runs on any shard): the buffer moves toward the gradient;
    the update is the gradient moved toward the buffer (nesterov) or the buffer itself."""
    buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(buffer, momentum) if nesterov else buffer.clone()
