"""Expert parallelism: split each MoE layer's experts over the ep axis (`split.py`)."""

from paratrain.parallel.ep.split import check_expert_parallel, expert_parallelize

__all__ = ["check_expert_parallel", "expert_parallelize"]
