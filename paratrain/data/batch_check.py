"""Catch a malformed micro-batch before it reaches the model: compare each one with the first.

A sample of the wrong shape or dtype deep in a dataset otherwise fails far from its cause (a shape error in
some layer, a silent broadcast, a float tensor used as token ids) or, under data parallelism, only on the
rank that drew it. The engine records the structure of the first micro-batch (tuple/list/dict nesting, and
each tensor's dtype and shape) and checks every later one against it before the forward.
"""

from __future__ import annotations

import torch

from paratrain.errors import Error


class BatchError(Error, ValueError):
    """A micro-batch whose structure, dtype or shape differs from the first one's."""


def _a(word: str) -> str:
    return f"an {word}" if word[:1] in "aeiou" else f"a {word}"


def tensor_spec(dtype: torch.dtype, shape: tuple) -> str:
    return f"{_a(str(dtype).removeprefix('torch.'))} tensor of shape {tuple(shape)}"


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return tensor_spec(value.dtype, value.shape)
    return _a(type(value).__name__)


class BatchChecker:
    """`mode`: "shape" (structure, dtypes, shapes), "dtype" (structure, dtypes, number of dimensions), "off"."""

    def __init__(self, mode: str, what: str):
        self.mode = mode
        self.what = what
        self.first = None
        self.count = 0

    def __call__(self, batch) -> None:
        self.count += 1
        if self.mode == "off":
            return
        if self.first is None:
            self.first = _skeleton(batch)
            return
        problem = self._compare(self.first, batch, "batch")
        if problem is not None:
            hint = "" if self.mode == "dtype" else " (set batch_check to \"dtype\" to allow shapes that vary, e.g. " \
                                                   "variable sequence lengths)"
            raise BatchError(f"{self.what} micro-batch {self.count}: {problem}; every micro-batch must have the "
                             f"structure, dtypes and shapes of the first one{hint}. Fix the dataset or collate_fn")

    def _compare(self, want, got, where: str) -> str | None:
        kind = want[0]
        if kind == "tensor":
            if not isinstance(got, torch.Tensor):
                return f"{where} is {describe(got)}, but in the first micro-batch it was a tensor"
            dtype, shape = want[1], want[2]
            wrong_shape = tuple(got.shape) != shape if self.mode == "shape" else got.dim() != len(shape)
            if got.dtype != dtype or wrong_shape:
                return f"{where} is {describe(got)}, but in the first micro-batch it was {tensor_spec(dtype, shape)}"
            return None
        if kind == "dict":
            if not isinstance(got, dict) or set(got) != set(want[1]):
                keys = sorted(got) if isinstance(got, dict) else None
                return f"{where} has keys {keys}, but the first micro-batch had {sorted(want[1])}"
            for k, sub in want[1].items():
                problem = self._compare(sub, got[k], f"{where}[{k!r}]")
                if problem:
                    return problem
            return None
        if kind == "seq":
            if not isinstance(got, (tuple, list)) or len(got) != len(want[1]):
                n = len(got) if isinstance(got, (tuple, list)) else describe(got)
                return f"{where} has {n} elements, but the first micro-batch had {len(want[1])}"
            for i, sub in enumerate(want[1]):
                problem = self._compare(sub, got[i], f"{where}[{i}]")
                if problem:
                    return problem
            return None
        if type(got) is not want[1]:
            return f"{where} is {describe(got)}, but in the first micro-batch it was {_a(want[1].__name__)}"
        return None


def _skeleton(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape))
    if isinstance(value, dict):
        return ("dict", {k: _skeleton(v) for k, v in value.items()})
    if isinstance(value, (tuple, list)):
        return ("seq", [_skeleton(v) for v in value])
    return ("other", type(value))
