"""Pipeline parallelism: layers cut into stages over the pp axis, micro-batches scheduled as data.

module.py (PipelineModule, LayerSpec, the GPT split), partition.py (where to cut), split.py (keep this
rank's stages), schedules.py (actions per rank), validate.py (deadlock/dependency check, unit-slot
simulation), runtime.py + p2p.py + weight_grad.py (execution), timeline.py (recording, bubbles, Gantt).
"""

from paratrain.pipeline.module import LayerSpec, PipelineModule
from paratrain.pipeline.schedules import Action, Schedule, ScheduleError, build_schedule
from paratrain.pipeline.validate import check_schedule, simulate, theoretical_bubble, validate

__all__ = ["Action", "LayerSpec", "PipelineModule", "Schedule", "ScheduleError", "build_schedule", "check_schedule",
           "simulate", "theoretical_bubble", "validate"]
