"""Reward functions with TRL's signature, named in the config, scored on each rank's rows and gathered.

    def correct_sum(prompts, completions, completion_ids, **columns) -> list[float | None]: ...
    "trainer": {"reward_funcs": ["rewards.py:correct_sum", "mypackage.rewards:format_ok"], "reward_weights": [1, 0.5]}

Each function gets this rank's rows (prompts and completions as text, or as message lists for conversational data;
`completion_ids` as lists of token ids; every extra column of the prompt rows, by name, one value per row) and returns
one reward per row: a float, or None where it does not apply (TRL's meaning: excluded from that function's mean; a
row no function scores gets advantage 0). A function that raises, returns another count, or a NaN or infinite value
is an error naming it. The ranks exchange their rewards (or their error) in one gather over the data-parallel axis,
so every rank raises the same error, or every rank holds the global batch's rewards in data-parallel order.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import paratrain.comm as comm
from paratrain.errors import Error, InvalidValueError
from paratrain.layout.mesh import Axis

FIELD = "trainer.reward_funcs"


class RewardError(Error, RuntimeError):
    """A reward function failed or gave what a reward cannot be."""


def load_reward_function(name: str) -> Callable:
    """'path/to/file.py:function' or 'package.module:function' -> the function."""
    where, _, attr = name.rpartition(":")
    if not where or not attr:
        raise InvalidValueError(f"{FIELD}: {name!r} does not name a function; write 'file.py:function' or "
                                f"'package.module:function'")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise InvalidValueError(f"{FIELD}: {name!r}: no file {path.resolve()}; give a path to a .py file "
                                    f"(relative to the directory the job runs in)")
        spec = importlib.util.spec_from_file_location(f"paratrain_rewards_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise InvalidValueError(f"{FIELD}: {name!r}: module {where!r} cannot be imported ({exc}); install it "
                                    f"or give 'file.py:function'") from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise InvalidValueError(f"{FIELD}: {name!r}: {where} has no function {attr!r}")
    return function


class RewardFunctions:
    """The job's reward functions, their names (TRL's: the function's __name__) and weights."""

    def __init__(self, functions: Sequence[Callable], weights: Sequence[float] | None = None,
                 names: Sequence[str] | None = None):
        if not functions:
            raise InvalidValueError(f"{FIELD} is empty: a grpo job needs at least one reward function")
        if weights is not None and len(weights) != len(functions):
            raise InvalidValueError(f"trainer.reward_weights has {len(weights)} weights for {len(functions)} reward "
                                    f"functions: give one weight per function")
        self.functions = list(functions)
        self.names = list(names) if names is not None else [getattr(f, "__name__", f"reward_{i}")
                                                             for i, f in enumerate(functions)]
        self.weights = torch.tensor(list(weights) if weights is not None else [1.0] * len(functions))

    @classmethod
    def named(cls, names: Sequence[str], weights: Sequence[float] | None = None) -> RewardFunctions:
        functions = [load_reward_function(name) for name in names]
        return cls(functions, weights)

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list],
              axis: Axis) -> torch.Tensor:
        """(global rows, functions) float32 rewards of every data-parallel rank's rows, in rank order (NaN: None).
        Collective over `axis`: every rank raises the same error when any rank's function failed."""
        mine: list[list[float]] | str
        try:
            mine = [self._one(i, prompts, completions, completion_ids, columns) for i in range(len(self.functions))]
        except RewardError as exc:
            mine = str(exc)
        gathered = comm.all_gather_object(mine, axis, tag="rewards")
        for rank, part in enumerate(gathered):
            if isinstance(part, str):
                raise RewardError(part if axis.size == 1 else f"on data-parallel rank {rank}: {part}")
        columns_by_function = [sum((part[i] for part in gathered), []) for i in range(len(self.functions))]
        return torch.tensor(columns_by_function, dtype=torch.float32).T.contiguous()

    def _one(self, i: int, prompts, completions, completion_ids, columns) -> list[float]:
        name = self.names[i]
        try:
            out = self.functions[i](prompts=prompts, completions=completions, completion_ids=completion_ids,
                                    **columns)
        except Exception as exc:
            raise RewardError(f"the reward function {name!r} ({FIELD}) raised {type(exc).__name__}: {exc}") from None
        out = list(out) if out is not None else None
        if out is None or len(out) != len(prompts):
            got = "None" if out is None else f"{len(out)} rewards"
            raise RewardError(f"the reward function {name!r} ({FIELD}) returned {got} for {len(prompts)} "
                              f"completions: return one reward (a float, or None where it does not apply) per "
                              f"completion")
        values = []
        for row, value in enumerate(out):
            if value is None:
                values.append(math.nan)
                continue
            value = float(value)
            if not math.isfinite(value):
                raise RewardError(f"the reward function {name!r} ({FIELD}) returned {value} for completion {row}: "
                                  f"return a finite float, or None where the reward does not apply")
            values.append(value)
        return values
