"""A pipeline's forward for generation: one micro-batch (the rows of a `generate` call) through every stage in
order, and the last stage's logits on every pp rank.

A decode step is one forward of a few tokens, so there is nothing to overlap and no schedule to follow: each
rank runs its stages in increasing order, receiving a stage's input from the rank of the stage before and
sending its output to the rank of the stage after (a header first: the shapes change from the prompt's
forward to a token's). Only the sampled position's logits leave the last stage. Stage s waits only for stage
s - 1, so the chain cannot deadlock (as `learn_shapes`).
The activations are the training hand-over (a tensor, or a tuple such as the Llama's (h, position_ids));
each stage's attention cores keep their own layers' keys and values (`paratrain.generation.kv_cache`).
Messages are counted under the tag "generate".
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import paratrain.comm as comm
from paratrain.attention import Documents
from paratrain.data.micro_batch import MicroBatch
from paratrain.parallel.pp.p2p import HEADER_LEN, as_tensors, decode, describe, encode

TAG = "generate"


def pipeline_logits(runtime, ids: torch.Tensor, positions: torch.Tensor, documents: Documents | None,
                    whole_vocabulary: Callable[[torch.Tensor], torch.Tensor], keep: int, width: dict) -> torch.Tensor:
    """The last stage's logits (b, V) of position `keep`, on every rank of the pp axis (the other positions' are
    never sent). `whole_vocabulary` runs on the last stage's ranks (all of one tp group: a vocabulary split over
    tp is gathered there before the broadcast). `width`: {} for a call's first forward, which learns the logits'
    width from the last stage; the call's later forwards send the logits alone."""
    schedule, axis, me = runtime.schedule, runtime.axis, runtime.rank
    batch = MicroBatch(ids, None, positions, documents)
    last = schedule.num_stages - 1
    outputs: dict[int, object] = {}
    for stage in range(schedule.num_stages):
        if schedule.rank_of(stage) != me:
            continue
        if stage == 0:
            x = ids
        elif schedule.rank_of(stage - 1) == me:
            x = outputs.pop(stage - 1)
        else:
            x = _receive(axis, schedule.rank_of(stage - 1), ids.device)
        outputs[stage] = runtime._run_chunk(stage, x, batch)
        if stage < last and schedule.rank_of(stage + 1) != me:
            _send(axis, outputs.pop(stage), schedule.rank_of(stage + 1))
    logits = whole_vocabulary(outputs[last][:, keep]) if last in outputs else None
    return _from_last_stage(logits, axis, schedule.rank_of(last), ids, width)


def _send(axis, value, peer: int) -> None:
    header = encode(describe(value)).to(as_tensors(value)[0].device)
    for handle in comm.send_recv([(header, peer)] + [(t.contiguous(), peer) for t in as_tensors(value)], [],
                                 axis, tag=TAG):
        handle.wait()


def _receive(axis, peer: int, device: torch.device):
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    for handle in comm.send_recv([], [(header, peer)], axis, tag=TAG):
        handle.wait()
    is_tuple, items = decode(header.cpu())
    buffers = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in items]
    for handle in comm.send_recv([], [(b, peer) for b in buffers], axis, tag=TAG):
        handle.wait()
    return tuple(buffers) if is_tuple else buffers[0]


def _from_last_stage(logits: torch.Tensor | None, axis, owner: int, ids: torch.Tensor, width: dict) -> torch.Tensor:
    """Broadcast the last stage's logits (b, V) over pp; V first, once per call (only that rank knows it)."""
    if "V" not in width:
        known = torch.tensor([0 if logits is None else logits.shape[-1]], dtype=torch.int64, device=ids.device)
        comm.broadcast(known, axis, src=owner, tag=TAG)
        width["V"] = int(known)
    if logits is None:
        logits = torch.empty(ids.shape[0], width["V"], device=ids.device)
    logits = logits.float().contiguous()
    comm.broadcast(logits, axis, src=owner, tag=TAG)
    return logits
