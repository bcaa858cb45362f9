"""Point-to-point traffic between stages: one batched isend/irecv per schedule gap, shapes learnt once.

A stage does not know in advance what its neighbour sends (a tensor or a tuple of tensors, their shapes
and dtypes). Before the first step, `learn_shapes` walks the stages in order once: each stage receives a
small int64 header from the previous one, runs a forward on an input of that shape (no grad, eval mode,
the RNG state restored, so training is unaffected), and sends the header describing its output to the
next. The chain visits stages in increasing order, so it cannot deadlock. From then on every gap of the
schedule is posted as exactly one batch — the unit `validate.simulate` proves deadlock-free — and
gradients need no header: they have the shapes of the activations a stage sent. Data messages are counted
under the tag "pp", headers under "pp_meta".
"""

from __future__ import annotations

import torch

import paratrain.comm as comm
from paratrain.errors import InvalidTypeError, InvalidValueError, RunError
from paratrain.layout.mesh import Axis

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
HEADER_LEN = 64
Meta = tuple[bool, tuple[tuple[tuple[int, ...], torch.dtype], ...]]  # (is a tuple, ((shape, dtype), ...))


def describe(value) -> Meta:
    if isinstance(value, torch.Tensor):
        return False, ((tuple(value.shape), value.dtype),)
    if isinstance(value, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in value):
        return True, tuple((tuple(t.shape), t.dtype) for t in value)
    raise InvalidTypeError(f"a pipeline stage must output a tensor or a tuple of tensors, got {type(value).__name__}"
                           + (f" of {[type(t).__name__ for t in value]}" if isinstance(value, (tuple, list)) else ""))


def encode(meta: Meta) -> torch.Tensor:
    is_tuple, items = meta
    flat = [int(is_tuple), len(items)]
    for shape, dtype in items:
        if dtype not in DTYPES:
            raise InvalidTypeError(f"pipeline stages cannot send tensors of dtype {dtype}; use one of {DTYPES}")
        flat += [DTYPES.index(dtype), len(shape), *shape]
    if len(flat) > HEADER_LEN:
        raise InvalidValueError(f"a stage output with {len(items)} tensors does not fit the {HEADER_LEN}-entry header")
    return torch.tensor(flat + [0] * (HEADER_LEN - len(flat)), dtype=torch.int64)


def decode(header: torch.Tensor) -> Meta:
    flat = header.tolist()
    is_tuple, n, pos, items = bool(flat[0]), flat[1], 2, []
    for _ in range(n):
        dtype, ndim = DTYPES[flat[pos]], flat[pos + 1]
        items.append((tuple(flat[pos + 2:pos + 2 + ndim]), dtype))
        pos += 2 + ndim
    return is_tuple, tuple(items)


def as_tensors(value) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


class Incoming:
    """A posted receive of one message: the buffers, and a wait that returns them once they are full."""

    def __init__(self, buffers: list[torch.Tensor], handles: list[comm.Handle], is_tuple: bool):
        self.buffers, self.handles, self.is_tuple = buffers, handles, is_tuple

    def wait(self) -> list[torch.Tensor]:
        for h in self.handles:
            h.wait()
        self.handles = []
        return self.buffers


class StageLinks:
    """Sends and receives of one rank on the pp axis, and the activation shapes of its stages."""

    def __init__(self, axis: Axis, device: torch.device):
        self.axis, self.device = axis, device
        self.sent: dict[int, Meta] = {}  # sending stage -> what it sends
        self.known: dict[int, Meta] = {}  # receiving stage -> what it receives
        self.in_flight: list[tuple[comm.Handle, list[torch.Tensor]]] = []  # sends not known to be done

    def learn_shapes(self, stages: list[int], num_stages: int, rank_of, run_chunk, first_inputs) -> None:
        """Once, before the first step: pass headers down the stages in order (see the module docstring).
        `run_chunk(stage, x)` runs a stage's forward."""
        outputs = {}
        for stage in stages:  # increasing: stage s waits only for s - 1
            if stage == 0:
                x = first_inputs
            elif rank_of(stage - 1) == self.axis.rank:  # the bottom of a V: the previous stage is this rank's
                x = outputs[stage - 1]
                self.known[stage] = describe(x)
            else:
                header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                for h in comm.send_recv([], [(header, rank_of(stage - 1))], self.axis, tag="pp_meta"):
                    h.wait()
                is_tuple, items = self.known[stage] = decode(header.cpu())
                zeros = [torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in items]
                x = tuple(zeros) if is_tuple else zeros[0]
            if stage < num_stages - 1:
                outputs[stage] = run_chunk(stage, x)
                meta = self.sent[stage] = describe(outputs[stage])
                if rank_of(stage + 1) == self.axis.rank:
                    continue  # handed over in place, no header
                for h in comm.send_recv([(encode(meta).to(self.device), rank_of(stage + 1))], [], self.axis,
                                        tag="pp_meta"):
                    h.wait()

    def check_sent(self, stage: int, value) -> None:
        meta = describe(value)
        if self.sent.get(stage) != meta:
            raise RunError(f"stage {stage} sends {meta[1]} but its output was {self.sent.get(stage, (0, ()))[1]} "
                           f"when the shapes were learnt; a stage's output shapes must stay the same between "
                           f"micro-batches and steps (same micro-batch size)")

    def post(self, sends: list[tuple[object, int]], recvs: list[tuple[Meta, int]]) -> list[Incoming]:
        """Post one gap's sends (value, peer pp rank) and receives (meta, peer) as one batch, in order;
        returns one Incoming per receive."""
        send_ops = [(t.detach().contiguous(), peer) for value, peer in sends for t in as_tensors(value)]
        buffers = [[torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in meta[1]]
                   for meta, _ in recvs]
        recv_ops = [(b, peer) for bufs, (_, peer) in zip(buffers, recvs) for b in bufs]
        handles = comm.send_recv(send_ops, recv_ops, self.axis, tag="pp")
        self.in_flight = [(h, ts) for h, ts in self.in_flight if not h.is_completed()]
        if len(handles) != len(send_ops) + len(recv_ops):  # NCCL coalesces a batch into one request
            self.in_flight += [(h, [t for t, _ in send_ops]) for h in handles]
            return [Incoming(bufs, list(handles), meta[0]) for bufs, (meta, _) in zip(buffers, recvs)]
        sent_handles, recv_handles = handles[:len(send_ops)], handles[len(send_ops):]
        self.in_flight += [(h, [t]) for h, (t, _) in zip(sent_handles, send_ops)]  # keep tensors alive until sent
        out, pos = [], 0
        for bufs, (meta, _) in zip(buffers, recvs):
            out.append(Incoming(bufs, recv_handles[pos:pos + len(bufs)], meta[0]))
            pos += len(bufs)
        return out

    def wait_sends(self) -> None:
        for h, _ in self.in_flight:
            h.wait()
        self.in_flight = []
