"""Tensor parallelism (Megatron-style), with sequence parallelism, driven by declarative plans.

    from paratrain.tensor_parallel import parallelize
    applied = parallelize(model, mesh, {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"})
"""

from paratrain.tensor_parallel.apply import AppliedPlan, parallelize
from paratrain.tensor_parallel.layers import (
    ColumnParallelLinear,
    PlanError,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from paratrain.tensor_parallel.loss import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from paratrain.tensor_parallel.plan import STYLES, match, resolve_plan
from paratrain.tensor_parallel.random import RNGTracker

__all__ = [
    "STYLES",
    "AppliedPlan",
    "ColumnParallelLinear",
    "PlanError",
    "RNGTracker",
    "RowParallelLinear",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "match",
    "parallelize",
    "resolve_plan",
    "vocab_parallel_cross_entropy",
]
