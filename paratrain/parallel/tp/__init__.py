"""Tensor parallelism (Megatron-style), with sequence parallelism, driven by declarative plans.

    from paratrain.parallel.tp import parallelize
    applied = parallelize(model, mesh, {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"})
"""

from paratrain.parallel.tp.apply import AppliedPlan, parallelize
from paratrain.parallel.tp.layers import (
    ColumnParallelLinear,
    PlanError,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from paratrain.parallel.tp.loss import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from paratrain.parallel.tp.plan import STYLES, match, resolve_plan
from paratrain.parallel.tp.random import RNGTracker

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
