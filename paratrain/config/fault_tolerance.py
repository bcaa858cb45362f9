"""The fault_tolerance section: replica groups on torchft (docs/fault-tolerance.md)."""

from __future__ import annotations

from pydantic import Field

from paratrain.config.errors import ConfigError
from paratrain.config.section import Section

# Set by `paratrain train --replica-groups R` (paratrain/launcher/replica_groups.py) for each group's processes:
GROUP_ENV = "PARATRAIN_REPLICA_GROUP"  # this process's group
GROUPS_ENV = "PARATRAIN_REPLICA_GROUPS"  # R
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable: the Lighthouse's address
START_STORE_ENV = "PARATRAIN_REPLICA_START"  # host:port of the launcher's store the groups' first start meets in


class InjectFailureConfig(Section):
    """A real SIGKILL, for tests and demos: one rank of one replica group kills itself in the middle of one step, in
    that group's first attempt only (its restarted processes train on)."""

    replica_group: int = Field(ge=0)
    """The group whose rank is killed."""
    at_step: int = Field(ge=1)
    """The optimizer step in whose middle it dies (after its backward, before the groups sum their gradients)."""
    rank: int = Field(1, ge=0)
    """The rank inside the group that is killed (the others are stopped by the group's launcher)."""


class FaultToleranceConfig(Section):
    """Replica groups (`paratrain train --replica-groups R`): each group is its own world of processes (any layout
    inside), and the groups sum their gradients through torchft's managed process group with a quorum and a commit
    vote every step. A group that fails is restarted and heals from a live peer; the survivors redo the failed step
    with the failed group's rows, so no row is lost and the run equals the uninterrupted one."""

    enabled: bool = False
    replica_groups: int = Field(2, ge=1)
    """How many replica groups train together (`--replica-groups` sets it)."""
    min_replicas: int = Field(1, ge=1)
    """A step commits only with at least this many groups in it; fewer wait (up to quorum_timeout_s) for more."""
    lighthouse: str | None = None
    """The torchft Lighthouse's address (http://host:port) for groups on several machines; None: `paratrain train
    --replica-groups` starts one on this machine."""
    heartbeat_timeout_s: float = Field(2.0, gt=0.0)
    """A group silent this long is out of the quorum (the Lighthouse's setting, when paratrain starts it)."""
    join_timeout_s: float = Field(1.0, gt=0.0)
    """How long the Lighthouse waits for more groups before it forms a quorum of at least min_replicas."""
    quorum_timeout_s: float = Field(120.0, gt=0.0)
    """A group waits this long for a quorum (the first one includes every group's start-up) before it fails."""
    timeout_s: float = Field(30.0, gt=0.0)
    """The groups' sums, the commit vote and a healing transfer fail after this long (the step is then redone)."""
    inject_failure: InjectFailureConfig | None = None


def check_failure_rank(failure: InjectFailureConfig | None, ranks: int, where: str) -> None:
    """`inject_failure.rank` names a rank each group has (else it would never fire); `where`: what gives the count."""
    if failure is not None and failure.rank >= ranks:
        raise ConfigError(f"fault_tolerance.inject_failure.rank = {failure.rank}, but {where} gives each group "
                          f"{ranks} rank(s); set it to at most {ranks - 1}")
