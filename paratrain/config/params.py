"""The optimizer's and the scheduler's `params`, checked by name and type when the config is read.

`optimizer.params` and `scheduler.params` go to a constructor as keyword arguments. Unchecked, a wrong value
fails deep inside torch, after the process groups exist, with a message that names no key ("'<=' not
supported between instances of 'float' and 'str'"). Here every param is checked against what its class
takes, on every rank and before any collective, and the error reads `optimizer.params.lr must be a number,
got 'fast'`.

What a param must be comes from, in this order: the tables below (DeepSpeed's meanings, and the ranges torch
enforces for Adam, AdamW and SGD); the type annotations of the torch class's constructor; nothing (a value
whose annotation says no simple kind, such as a callable, is left to the class).
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.config.errors import ConfigError


@dataclass(frozen=True)
class Kind:
    """What a param's value must be: `words` complete the sentence "... must be <words>"."""

    words: str
    accepts: Callable[[Any], bool]


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):  # torch takes a 0-dim tensor lr (capturable optimizers)
        return value.dim() == 0 and value.is_floating_point()
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # True is an int to Python


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def optional(kind: Kind) -> Kind:
    return Kind(kind.words.replace(" or ", ", ") + " or null", lambda v: v is None or kind.accepts(v))


def one_of(*choices: Any) -> Kind:
    words = " or ".join(repr(c) for c in choices) if len(choices) < 3 else \
        "one of " + ", ".join(repr(c) for c in choices)
    return Kind(words, lambda v: any(type(v) is type(c) and v == c for c in choices))


def numbers(count: int) -> Kind:
    return Kind(f"a list of {count} numbers",
                lambda v: isinstance(v, (list, tuple)) and len(v) == count and all(_is_number(x) for x in v))


NUMBER = Kind("a number", _is_number)
NON_NEGATIVE = Kind("a non-negative number", lambda v: _is_number(v) and v >= 0)
INTEGER = Kind("an integer", _is_integer)
POSITIVE_INTEGER = Kind("a positive integer", lambda v: _is_integer(v) and v > 0)
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
STRING = Kind("a string", lambda v: isinstance(v, str))
BETAS = Kind("a pair of numbers in [0, 1)", lambda v: numbers(2).accepts(v) and all(0 <= b < 1 for b in v))

# Stricter than the annotations: the ranges torch checks in the constructor, and DeepSpeed's own keys.
_ADAM = {"lr": NON_NEGATIVE, "betas": BETAS, "eps": NON_NEGATIVE, "weight_decay": NON_NEGATIVE,
         "adam_w_mode": BOOL, "torch_adam": BOOL}
_SGD = {"lr": NON_NEGATIVE, "momentum": NON_NEGATIVE, "weight_decay": NON_NEGATIVE}
NAME_PATTERNS = Kind("a list of name patterns (strings, fnmatch style)",
                     lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
# paratrain.muon.Muon: torch's Muon parameters, `adamw` (the AdamW part's options) and which parameters go where.
_MUON_ADAMW = {key: _ADAM[key] for key in ("lr", "betas", "eps", "weight_decay")}
MUON_PARAMS = {"lr": NON_NEGATIVE, "weight_decay": NON_NEGATIVE, "momentum": NON_NEGATIVE, "nesterov": BOOL,
               "ns_coefficients": numbers(3), "eps": NON_NEGATIVE, "ns_steps": POSITIVE_INTEGER,
               "adjust_lr_fn": optional(one_of("original", "match_rms_adamw")),
               "ns_dtype": one_of("bfloat16", "float32"),
               "adamw": Kind("a dict of AdamW options (lr, betas, eps, weight_decay)", lambda v: isinstance(v, dict)),
               "muon_names": NAME_PATTERNS, "adamw_names": NAME_PATTERNS,
               # DeepSpeed's Muon keys (paratrain.optim.muon_options reads a config holding them DeepSpeed's way)
               "muon_lr": NON_NEGATIVE, "adam_lr": NON_NEGATIVE, "betas": BETAS,
               "ns_method": one_of("standard", "gram")}
_DEEPSPEED_OPTIMIZER_KEYS = ("adam_w_mode", "torch_adam")  # DeepSpeed's switches, read by build_optimizer

# DeepSpeed's schedules (implemented in paratrain.optim, which sits above config): every param, and which are
# required. tests/unit/test_optim_params.py checks these against the classes' signatures.
_WARMUP = {"warmup_min_lr": NUMBER, "warmup_max_lr": optional(NUMBER), "warmup_num_steps": POSITIVE_INTEGER,
           "warmup_type": one_of("log", "linear"), "last_batch_iteration": INTEGER}
DEEPSPEED_SCHEDULE_PARAMS: dict[str, tuple[dict[str, Kind], tuple[str, ...]]] = {
    "WarmupLR": (_WARMUP, ()),
    "WarmupDecayLR": ({"total_num_steps": POSITIVE_INTEGER, **_WARMUP}, ("total_num_steps",)),
    "WarmupCosineLR": ({"total_num_steps": POSITIVE_INTEGER, "warmup_min_ratio": NUMBER,
                        "warmup_num_steps": POSITIVE_INTEGER, "cos_min_ratio": NUMBER,
                        "warmup_type": one_of("log", "linear"), "last_batch_iteration": INTEGER},
                       ("total_num_steps",)),
}


def optimizer_class(name: str, params: dict[str, Any]) -> type[torch.optim.Optimizer]:
    """The torch class that `optimizer.type` names, with DeepSpeed's meaning of Adam and AdamW."""
    if name.lower() in ("adam", "adamw"):
        adam_w_mode = params.get("adam_w_mode", True) or name.lower() == "adamw"
        return torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"config key 'optimizer.type' = {name!r} is not an optimizer paratrain knows; use "
                          f"Adam, AdamW, SGD or the name of a torch.optim class (e.g. 'Adagrad')")
    return cls


def check_optimizer_params(name: str, params: dict[str, Any]) -> None:
    """Raise a ConfigError naming the first param of `optimizer.params` that `name` does not take as given."""
    if name.lower() == "muon":
        _check("Muon", "optimizer.params", params, dict(MUON_PARAMS), set(), open_ended=False)
        if params.get("ns_method") == "gram":
            raise ConfigError("optimizer.params.ns_method = 'gram': paratrain runs torch's Newton-Schulz iteration "
                              "('standard'); remove the key or set it to 'standard' (its dtype: ns_dtype)")
        _check("Muon's AdamW part", "optimizer.params.adamw", params.get("adamw", {}), dict(_MUON_ADAMW), set(),
               open_ended=False)
        return
    if "adam_w_mode" in params and name.lower() in ("adam", "adamw"):
        _check_value("optimizer.params.adam_w_mode", params["adam_w_mode"], BOOL)  # it picks the class
    cls = optimizer_class(name, params)
    kinds, required, open_ended = _signature(cls, skip=("params",))
    overrides = _ADAM if cls in (torch.optim.Adam, torch.optim.AdamW) else _SGD if cls is torch.optim.SGD else {}
    kinds.update(overrides)
    _check(f"{cls.__name__} ({name})" if cls.__name__ != name else name, "optimizer.params", params, kinds,
           required, open_ended)


def check_scheduler_params(name: str, params: dict[str, Any]) -> None:
    """Raise a ConfigError for an unknown `scheduler.type` or the first param it does not take as given."""
    if name in DEEPSPEED_SCHEDULE_PARAMS:
        kinds, required = DEEPSPEED_SCHEDULE_PARAMS[name]
        _check(name, "scheduler.params", params, dict(kinds), set(required), open_ended=False)
        return
    cls = getattr(torch.optim.lr_scheduler, name, None)
    if not isinstance(cls, type):
        raise ConfigError(f"config key 'scheduler.type' = {name!r} is not supported; use one of "
                          f"{', '.join(DEEPSPEED_SCHEDULE_PARAMS)} or a torch.optim.lr_scheduler class name "
                          f"(DeepSpeed's OneCycle and LRRangeTest are not implemented)")
    kinds, required, open_ended = _signature(cls, skip=("optimizer",))
    _check(name, "scheduler.params", params, kinds, required, open_ended)


def _check(owner: str, where: str, params: dict[str, Any], kinds: dict[str, Kind | None], required: set[str],
           open_ended: bool) -> None:
    for key in params:
        if key not in kinds and not open_ended:
            close = difflib.get_close_matches(key, sorted(kinds), n=1, cutoff=0.6)
            hint = f"did you mean '{where}.{close[0]}'?" if close else f"{owner} takes: {', '.join(kinds)}"
            raise ConfigError(f"unknown config key '{where}.{key}' for {owner}; {hint}")
    missing = [key for key in kinds if key in required and key not in params]
    if missing:
        raise ConfigError(f"{where}.{missing[0]} is required by {owner}; set it in '{where}'")
    for key, value in params.items():
        kind = kinds.get(key)
        if kind is not None:
            _check_value(f"{where}.{key}", value, kind)


def _check_value(path: str, value: Any, kind: Kind) -> None:
    if not kind.accepts(value):
        raise ConfigError(f"{path} must be {kind.words}, got {value!r}")


def _signature(cls: type, skip: tuple[str, ...]) -> tuple[dict[str, Kind | None], set[str], bool]:
    """The constructor's keyword params with the kind their annotation says, the required ones, and whether
    it takes any keyword (**kwargs)."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an annotation that names a type torch imports only for type checkers
        hints = {}
    kinds = {p.name: _kind_of(hints.get(p.name)) for p in parameters
             if p.name not in skip and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = {p.name for p in parameters if p.name in kinds and p.default is p.empty}
    return kinds, required, any(p.kind is p.VAR_KEYWORD for p in parameters)


def _kind_of(annotation: Any) -> Kind | None:
    """The kind an annotation asks for, or None where it names no simple kind (left to the class)."""
    simple = {float: NUMBER, int: INTEGER, bool: BOOL, str: STRING}
    if annotation in simple:
        return simple[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return one_of(*args)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a not in (type(None), torch.Tensor)]  # a tensor stands in for a number
        kind = _kind_of(rest[0]) if len(rest) == 1 else None
        return optional(kind) if kind is not None and type(None) in args else kind
    if origin is tuple and args and all(_kind_of(a) is NUMBER for a in args):
        return numbers(len(args))
    return None
