"""The one pipeline builder every decoder family uses: embed -> blocks[0..n-1] -> final (norm + head).

A family's spec hands over its own modules (shared, not copied: the pipeline split keeps or frees them) and
the names its checkpoints use; only what enters the first stage and leaves the last differs between families
(the Llama's embedding stage also carries the position ids, the MoE's the router losses, a transformers
model's its attention mask and positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from paratrain.parallel.pp.module import PipelineModule


def decoder_pipeline(embed: nn.Module, blocks: Sequence[nn.Module], final: nn.Module, loss_fn: nn.Module, *,
                     embed_name: str, blocks_prefix: str,
                     example_shape: tuple[int, int, int] | None = None) -> PipelineModule:
    """The pipeline of `embed`, each of `blocks` and `final`, whose layers are known by the model's own names:
    `embed_name`, `blocks_prefix.i`, and "" for the final stage (its submodules carry their full names).
    `example_shape` (vocabulary, micro-batch, sequence length) makes the example input a balanced partition
    profiles (a fixed draw of token ids); None when the first stage cannot take bare token ids."""
    names = [embed_name, *(f"{blocks_prefix}.{i}" for i in range(len(blocks))), ""]
    example = None
    if example_shape is not None:
        vocab, micro_batch, seq_len = example_shape
        example = torch.randint(0, vocab, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
    return PipelineModule([embed, *blocks, final], loss_fn=loss_fn, layer_names=names, example_input=example)
