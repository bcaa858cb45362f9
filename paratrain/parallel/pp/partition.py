"""Cutting a list of layers into contiguous stages: by count, by parameters, by measured time, or by hand.

Every method reduces to weights per layer and one rule: minimize the heaviest stage, then (among the
splits with that bottleneck) the sum of squared stage weights, so the remaining stages are as even as
possible too. `uniform` weighs every layer 1, `parameters` by its trainable parameter count (DeepSpeed's
default), `balanced` by the forward + backward time a short profile measured.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from paratrain.adapters.quantized import encoded_values
from paratrain.errors import Error

METHODS = ("uniform", "parameters", "balanced")


class PartitionError(Error, ValueError):
    """A partition that cannot be made; the message names the sizes and the fix."""


def balanced_boundaries(weights: Sequence[float], parts: int) -> list[int]:
    """Boundaries [0, b1, ..., len(weights)] of `parts` non-empty contiguous parts with the smallest
    maximum part weight, ties broken by the smallest sum of squared part weights."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise PartitionError(f"cannot cut {n} layers into {parts} stages: every stage needs at least one layer; "
                             f"use at most {n} stages (pipeline.stages x pipeline.virtual_stages) or more layers")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = (float("inf"), float("inf"))
    # best[j][i]: (bottleneck, sum of squares) of the first i layers in j parts; cut[j][i]: where part j starts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0.0, 0.0)
    for j in range(1, parts + 1):
        for i in range(j, n - (parts - j) + 1):
            for t in range(j - 1, i):
                prev = best[j - 1][t]
                if prev == inf:
                    continue
                w = prefix[i] - prefix[t]
                cand = (max(prev[0], w), prev[1] + w * w)
                if cand < best[j][i]:
                    best[j][i], cut[j][i] = cand, t
    bounds, i = [n], n
    for j in range(parts, 0, -1):
        i = cut[j][i]
        bounds.append(i)
    return bounds[::-1]


def check_manual(bounds: Sequence[int], num_layers: int, parts: int) -> list[int]:
    bounds = list(bounds)
    ok = (len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == num_layers
          and all(a < b for a, b in zip(bounds, bounds[1:])))
    if not ok:
        raise PartitionError(f"pipeline.partition {bounds} must list the stage boundaries: {parts + 1} strictly "
                             f"increasing numbers from 0 to the number of layers ({num_layers}), e.g. "
                             f"{balanced_boundaries([1.0] * num_layers, parts) if parts <= num_layers else '...'}")
    return bounds


def parameter_counts(layers: Sequence) -> list[int]:
    """Parameters per layer, frozen ones too: a frozen weight costs a layer the same forward and input-gradient
    compute, so a LoRA model balances on its base, not its adapters (a LayerSpec is built on the meta device)."""
    out = []
    for layer in layers:
        if hasattr(layer, "build") and not isinstance(layer, nn.Module):
            with torch.device("meta"):
                layer = layer.build()
        params = layer.parameters() if isinstance(layer, nn.Module) else []
        # a 4-bit weight (QLoRA) costs what its values cost, two per packed byte
        out.append(sum(encoded_values(p) or p.numel() for p in params))
    return out


def _floats(value) -> list[torch.Tensor]:
    items = value if isinstance(value, (tuple, list)) else (value,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _detached(value, requires_grad: bool):
    def one(t):
        if isinstance(t, torch.Tensor):
            t = t.detach()
            return t.requires_grad_(requires_grad) if t.is_floating_point() else t
        return t
    return tuple(one(t) for t in value) if isinstance(value, (tuple, list)) else one(value)


def profile_layer_costs(layers: Sequence[nn.Module], example_input, repeats: int = 5) -> list[float]:
    """Forward + backward seconds per layer on `example_input`, one layer at a time: the fastest of
    `repeats` runs after one warm-up (on a shared machine noise only ever adds time).

    Each layer gets a detached copy of the previous layer's output as input, and a backward with
    gradient ones on its floating-point outputs, so its time is its own."""
    times: list[list[float]] = [[] for _ in layers]
    for _ in range(repeats + 1):
        x = example_input
        for k, layer in enumerate(layers):
            x_in = _detached(x, requires_grad=k > 0)
            start = time.perf_counter()
            y = layer(x_in)
            outs = [t for t in _floats(y) if t.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            times[k].append(time.perf_counter() - start)
            x = _detached(y, requires_grad=False)
        for layer in layers:
            if isinstance(layer, nn.Module):
                layer.zero_grad(set_to_none=True)
    return [min(t[1:]) for t in times]
