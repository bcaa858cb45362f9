"""Counting every collective: calls, payload elements and bytes, per mesh axis, operation and tag.

Payload is the logical size of the operation (the full tensor for all-reduce, the gathered output for
all-gather, the unreduced input for reduce-scatter, the message for send/recv), so counts can be compared
with the formulas in docs/strategies.md without knowing the algorithm the backend uses.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

# The scalars a step exchanges about itself rather than about the model: its loss and target count, the token
# loss's backprop unit, logged metrics, the peers' batch fingerprints. Benchmarks that compare a strategy's
# traffic with its formula leave them out; the planner predicts them too.
BOOKKEEPING_TAGS = frozenset({"metrics", "loss", "loss_unit", "batch_check"})


@dataclass
class OpCount:
    calls: int = 0
    elements: int = 0
    bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "elements": self.elements, "bytes": self.bytes}


class CommStats:
    """Accumulates counts until `reset()`. Keys are (axis, op, tag); tag says why (grad, param, metrics...)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, str], OpCount] = defaultdict(OpCount)

    def record(self, axis: str, op: str, elements: int, element_size: int, tag: str = "") -> None:
        count = self._counts[(axis, op, tag)]
        count.calls += 1
        count.elements += elements
        count.bytes += elements * element_size

    def reset(self) -> None:
        self._counts.clear()

    def snapshot(self, by_tag: bool = False) -> dict:
        """{axis: {op: {calls, elements, bytes}}}, or {axis: {op: {tag: {...}}}} with by_tag."""
        out: dict = {}
        for (axis, op, tag), count in sorted(self._counts.items()):
            ops = out.setdefault(axis, {})
            if by_tag:
                ops.setdefault(op, {})[tag] = count.as_dict()
            else:
                total = ops.setdefault(op, {"calls": 0, "elements": 0, "bytes": 0})
                for key, value in count.as_dict().items():
                    total[key] += value
        return out

    def total(self, axis: str | None = None, op: str | None = None, tag: str | None = None) -> OpCount:
        """Sum over the entries matching the given filters (None matches everything)."""
        out = OpCount()
        for (a, o, t), count in self._counts.items():
            if (axis is None or a == axis) and (op is None or o == op) and (tag is None or t == tag):
                out.calls += count.calls
                out.elements += count.elements
                out.bytes += count.bytes
        return out
