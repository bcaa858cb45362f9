"""The layout planner: a cost model of memory, communication and time, and a search over layouts.

    from paratrain.planner import Hardware, model_shape, plan
    result = plan(model_shape("gpt-7b"), gpus=64, global_batch=1024, hw=Hardware())
    best = result.ranked[0]          # .layout, .memory (bytes by kind), .time (seconds by part)

Every formula is a pure function (tested in one process); `tests/distributed/test_planner_calibration.py` checks the
predicted model-state bytes and communication against `engine.memory_stats()` / `engine.comm_stats()`.
See docs/planner.md.
"""

from paratrain.planner.comm import Transfer, predict_comm, rank_transfers
from paratrain.planner.enumerate import Evaluation, PlanResult, SearchSpace, enumerate_layouts, evaluate
from paratrain.planner.hardware import Hardware
from paratrain.planner.layout import Layout
from paratrain.planner.memory import MemoryEstimate, estimate_memory, expert_state_bytes
from paratrain.planner.model_shape import ModelShape, PlannerError, model_shape, shape_from_config
from paratrain.planner.report import layout_config
from paratrain.planner.search import plan
from paratrain.planner.states import model_state_bytes
from paratrain.planner.step_time import TimeEstimate, estimate_time

__all__ = [
    "Evaluation",
    "Hardware",
    "Layout",
    "MemoryEstimate",
    "ModelShape",
    "PlanResult",
    "PlannerError",
    "SearchSpace",
    "TimeEstimate",
    "Transfer",
    "enumerate_layouts",
    "estimate_memory",
    "estimate_time",
    "expert_state_bytes",
    "evaluate",
    "layout_config",
    "model_shape",
    "model_state_bytes",
    "plan",
    "predict_comm",
    "rank_transfers",
    "shape_from_config",
]
