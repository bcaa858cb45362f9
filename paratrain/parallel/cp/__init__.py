"""Context parallelism: the sequence split over the cp axis, exact causal attention by ring attention, by
Ulysses' all-to-all, or by both (USP).

    from paratrain.parallel.cp import context_parallelize
    applied = context_parallelize(model, mesh)   # ring attention cores + the split of the inputs
"""

from paratrain.parallel.cp.apply import (
    AppliedContextParallel,
    check_context_parallel,
    context_parallelize,
    context_parallelize_stages,
)
from paratrain.parallel.cp.ring_attention import RingAttentionCore, ring_attention
from paratrain.parallel.cp.sharding import (
    SequenceSplit,
    SequenceSplitError,
    chunk_ids,
    local_positions,
    merge_sequence,
    split_sequence,
)
from paratrain.parallel.cp.ulysses import UlyssesAttentionCore

__all__ = [
    "AppliedContextParallel",
    "RingAttentionCore",
    "SequenceSplit",
    "SequenceSplitError",
    "UlyssesAttentionCore",
    "check_context_parallel",
    "chunk_ids",
    "context_parallelize",
    "context_parallelize_stages",
    "local_positions",
    "merge_sequence",
    "ring_attention",
    "split_sequence",
]
