"""Human-friendly quantities for the planner's flags: 80GiB, 300GB/s, 400Gb/s, 10us, 989 (TFLOP/s)."""

from __future__ import annotations

import re

from paratrain.planner.model_shape import PlannerError

_BYTES = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"


def _split(text: str, flag: str) -> tuple[float, str]:
    match = re.fullmatch(_NUMBER + r"([A-Za-zµ/]*)\s*", str(text))
    if not match:
        raise PlannerError(f"{flag} {text!r}: expected a number with an optional unit")
    return float(match.group(1)), match.group(2)


def parse_bytes(text: str | float, flag: str = "--gpu-memory") -> float:
    """'80GiB' -> 85899345920; 'GB' is 1e9, 'GiB' 2**30; a bare number is bytes."""
    value, unit = _split(str(text), flag)
    key = unit.lower()
    if key not in _BYTES:
        raise PlannerError(f"{flag} {text!r}: unknown unit {unit!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
    return value * _BYTES[key]


def parse_rate(text: str | float, flag: str) -> float:
    """Bytes per second: '300GB/s' (bytes), '400Gb/s' or '400Gbps' (bits); a bare number is bytes/s."""
    value, unit = _split(str(text), flag)
    unit = unit.removesuffix("/s").removesuffix("ps")
    if unit[-1:] == "b" and unit[:-1].lower() in ("k", "m", "g", "t"):  # bits
        return value * _BYTES[unit[:-1].lower() + "b"] / 8
    key = unit.lower()
    if key not in _BYTES:
        raise PlannerError(f"{flag} {text!r}: unknown unit; use e.g. 300GB/s, 25GiB/s or 400Gb/s")
    return value * _BYTES[key]


def parse_seconds(text: str | float, flag: str = "--latency") -> float:
    value, unit = _split(str(text), flag)
    if unit not in _SECONDS:
        raise PlannerError(f"{flag} {text!r}: unknown unit {unit!r}; use s, ms, us or ns")
    return value * _SECONDS[unit]


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def format_seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.0f} us"
