"""Attention on one (query block, key block) pair, returning what the ring needs: the block's output
normalized within the block and the log-sum-exp of its scores; and the exact backward of a block given
the *final* output and log-sum-exp of its query rows (so the probabilities are the globally normalized
ones: P = exp(S − lse), dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O))).

A block may also take `mask` (b or 1, 1, sq, sk) bool, True where a query may attend a key (packed documents,
padding, a sliding window: `paratrain.attention`); a query row with nothing to attend in the block gets output
0 and lse −inf, so merging it changes nothing.

Two implementations with one contract, all tensors (b, h, s, d), lse (b, h, s):
  flash_cpu  torch's fused CPU flash-attention kernels (the ones behind F.scaled_dot_product_attention on
             CPU), which take and return the log-sum-exp; never materialize the (s, s) scores
  math       plain matmuls (any device and dtype); the reference the fused kernels are tested against
`pick("auto", device)` uses flash_cpu on CPU when this torch has it, math elsewhere.
"""

from __future__ import annotations

import torch

from paratrain.errors import InvalidValueError

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, mask=None) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (b, h, sq, sk)
    if causal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1)
        s.masked_fill_(future, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _empty_rows(out, lse, mask):
    """Rows with nothing to attend in the block: output 0, lse −inf (a kernel may give NaN or lse 0)."""
    if mask is None:
        return out, lse
    empty = ~mask.any(dim=-1)  # (b|1, 1, sq)
    return out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, float("-inf"))


def math_forward(q, k, v, scale: float, causal: bool, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    s = _scores(q, k, scale, causal, mask)
    lse = torch.logsumexp(s, dim=-1)  # (b, h, sq)
    return _empty_rows(torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse, mask)


def math_backward(do, q, k, v, out, lse, scale: float, causal: bool, mask=None):
    p = torch.exp(_scores(q, k, scale, causal, mask) - lse.unsqueeze(-1))  # (b, h, sq, sk), globally normalized
    dv = torch.matmul(p.transpose(-2, -1), do)
    ds = p * (torch.matmul(do, v.transpose(-2, -1)) - (do * out).sum(-1, keepdim=True))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


def _additive(mask, dtype):
    """The fused kernels' form of a mask: 0 where allowed, −inf elsewhere, in the inputs' dtype."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def flash_cpu_forward(q, k, v, scale: float, causal: bool, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale)
    return _empty_rows(out, lse, mask)


def flash_cpu_backward(do, q, k, v, out, lse, scale: float, causal: bool, mask=None):
    # The kernel derives rowsum(dO ∘ O) from the `out` it is given: the final output, as the ring needs.
    dq, dk, dv = _FLASH_CPU_BACKWARD(do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                     out.contiguous(), lse.contiguous(), 0.0, causal,
                                     attn_mask=_additive(mask, q.dtype), scale=scale)
    return dq, dk, dv


KERNELS = {"math": (math_forward, math_backward), "flash_cpu": (flash_cpu_forward, flash_cpu_backward)}


def pick(kernel: str, device: torch.device):
    """(forward, backward) for `kernel` in {"auto", "math", "flash_cpu"}."""
    if kernel == "auto":
        kernel = "flash_cpu" if device.type == "cpu" and _FLASH_CPU is not None else "math"
    if kernel not in KERNELS:
        raise InvalidValueError(f"unknown attention block kernel {kernel!r}; use auto, {', '.join(KERNELS)}")
    if kernel == "flash_cpu" and (device.type != "cpu" or _FLASH_CPU is None):
        raise InvalidValueError("the flash_cpu block kernel needs CPU tensors and a torch with "
                                "aten._scaled_dot_product_flash_attention_for_cpu; use kernel='math'")
    return KERNELS[kernel]
