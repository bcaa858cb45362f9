"""Pipeline parallelism: layers cut into stages over the pp axis, micro-batches scheduled as data.

module.py (PipelineModule, LayerSpec, the GPT split), partition.py (where to cut), split.py (keep this
rank's stages), schedules.py (actions per rank), validate.py (deadlock/dependency check, unit-slot
simulation), runtime.py + p2p.py + weight_grad.py (execution), timeline.py (recording, bubbles, Gantt).
"""

from paratrain.parallel.pp.module import LayerSpec, PipelineModule
from paratrain.parallel.pp.schedules import Action, Schedule, ScheduleError, build_schedule
from paratrain.parallel.pp.validate import check_schedule, simulate, theoretical_bubble, validate

__all__ = ["Action", "LayerSpec", "PipelineModule", "Schedule", "ScheduleError", "build_schedule", "check_schedule",
           "simulate", "theoretical_bubble", "validate"]


def __getattr__(name: str):
    """deepspeed.pipe.<name> that paratrain does not provide (TiedLayerSpec, topologies)."""
    from paratrain.compat.names import PIPE, refuse

    refuse(PIPE, "paratrain.parallel.pp (deepspeed.pipe)", name)
