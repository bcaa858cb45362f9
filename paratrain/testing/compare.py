"""How close two runs are: the measures the parity tests and `paratrain verify` use."""

from __future__ import annotations

import torch

from paratrain.errors import InvalidValueError, MissingKeyError


def rel_diff(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    """||a - b|| / ||b|| (L2 over all elements; |a - b| / |b| for scalars), with a 1e-12 floor.

    [Note: why a norm] Adam normalizes each gradient element by its own magnitude, so an element whose
    true gradient is ~0 (a GELU unit that never fires, say) moves by rounding noise times the learning
    rate in both runs. Measured element-wise, such an element dominates; measured as a norm over the
    tensor, it weighs what it is: one element out of thousands.
    """
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        raise InvalidValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def max_rel_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The worst `rel_diff` over matching entries of two state dicts, and its name."""
    missing = sorted(set(want) ^ set(got))
    if missing:
        raise MissingKeyError(f"state dicts differ in keys: {missing[:8]}")
    worst, name = 0.0, ""
    for key in want:
        d = rel_diff(got[key], want[key])
        if d > worst:
            worst, name = d, key
    return worst, name
