"""The vocabulary of pipeline schedules: action kinds, actions, the schedule record, and where stages live.

Both schedule builders (`schedules.py`: GPipe, 1F1B, interleaved, ZB-H1; `v_schedules.py`: ZB-V and
DualPipeV) write their orders in these terms, and the runtime, the validator and the timeline read them; the
builders import this module and never each other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from paratrain.config.parallel import SCHEDULES, V_SCHEDULES  # noqa: F401 (the names, re-exported)
from paratrain.errors import Error


class ActionKind(Enum):
    """What an action does. The value is the short form printed in `F3@s1` and stored in timelines."""

    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_comm(self) -> bool:
        return self.is_send or self.is_recv

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_F, ActionKind.RECV_B)

    def __str__(self) -> str:
        return self.value  # an Enum without a mixin formats with __str__: f"{kind}" is the short form too


F, B, W = ActionKind.F, ActionKind.B, ActionKind.W  # the short names the schedules are written in
SEND_F, RECV_F, SEND_B, RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B


def partial_backwards(name: str, stages: int, virtual: int) -> bool:
    """Whether one backward of the pipeline reaches only part of a rank's parameters: two chunks per rank
    (interleaved, the V schedules) or a backward split into B and W (ZB-H1, ZB-V, DualPipeV). A data-parallel
    strategy that reduces after every backward (ZeRO-2) must then reduce at each parameter's last gradient."""
    return stages > 1 and (virtual > 1 or name in ("zb-h1", *V_SCHEDULES))


def placement_of(name: str) -> str:
    """Where a schedule puts its stages: "loop" (stage s on rank s mod p) or "v"."""
    return "v" if name in V_SCHEDULES else "loop"


def rank_of_stage(placement: str, stage: int, ranks: int) -> int:
    if placement == "v" and stage >= ranks:
        return 2 * ranks - 1 - stage
    return stage % ranks


def stages_of_rank(placement: str, rank: int, ranks: int, virtual: int) -> list[int]:
    """The stages rank `rank` holds, chunk by chunk."""
    if placement == "v":
        return [rank, 2 * ranks - 1 - rank]
    return [c * ranks + rank for c in range(virtual)]


class ScheduleError(Error, ValueError):
    """A schedule that cannot be built for these sizes; the message names the sizes and the fix."""


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    stage: int
    micro: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))  # Action("F", 0, 0) == Action(F, 0, 0)

    @property
    def is_comm(self) -> bool:
        return self.kind.is_comm

    @property
    def peer_stage(self) -> int:
        """The stage on the other end of a communication action."""
        return self.stage + 1 if self.kind in (SEND_F, RECV_B) else self.stage - 1

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}@s{self.stage}"

    __repr__ = __str__


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: int  # p: pipeline ranks
    virtual: int  # v: stages (chunks) per rank
    micro_batches: int  # m
    split_backward: bool  # True when B is the input gradient only and W computes the weight gradient
    actions: tuple[tuple[Action, ...], ...]  # per rank, in execution order
    forward_only: bool = False
    placement: str = "loop"  # "loop": stage s on rank s mod p; "v": ranks hold stages r and 2p - 1 - r

    @property
    def num_stages(self) -> int:
        return self.stages * self.virtual

    def rank_of(self, stage: int) -> int:
        return rank_of_stage(self.placement, stage, self.stages)

    def local(self, stage: int, other: int) -> bool:
        """Whether two stages live on one rank (their boundary needs no message)."""
        return 0 <= other < self.num_stages and self.rank_of(stage) == self.rank_of(other)

    def chunk_of(self, stage: int) -> int:
        return stage // self.stages

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if not a.is_comm]

    def describe(self, rank: int) -> str:
        return " ".join(str(a) for a in self.actions[rank])


def sends_first(actions: list[Action]) -> list[Action]:
    """Within each run of communication actions, sends before receives (the order the runtime posts)."""
    out: list[Action] = []
    run: list[Action] = []
    for a in [*actions, None]:
        if a is not None and a.is_comm:
            run.append(a)
            continue
        out += [x for x in run if x.kind.is_send] + [x for x in run if x.kind.is_recv]
        run = []
        if a is not None:
            out.append(a)
    return out
