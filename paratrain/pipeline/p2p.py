"""Point-to-point traffic between stages: batched isend/irecv on the pp axis, with shapes learnt once.

A stage does not know in advance what its neighbour sends (a tensor or a tuple of tensors, their
shapes and dtypes). The first time a stage sends activations it sends a small int64 header describing
them right before the data, and the receiver reads the header before posting the data receive; both
sides remember it, so later micro-batches and steps send only data (DeepSpeed does the same). Gradients
need no header: they have the shapes of the activations the receiver itself sent. Messages are counted
under the tag "pp" (data) and "pp_meta" (headers).
"""

from __future__ import annotations

import torch

from paratrain import comm
from paratrain.mesh import Axis

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
HEADER_LEN = 64
Meta = tuple[bool, tuple[tuple[tuple[int, ...], torch.dtype], ...]]  # (is a tuple, ((shape, dtype), ...))


def describe(value) -> Meta:
    if isinstance(value, torch.Tensor):
        return False, ((tuple(value.shape), value.dtype),)
    if isinstance(value, (tuple, list)) and value and all(isinstance(t, torch.Tensor) for t in value):
        return True, tuple((tuple(t.shape), t.dtype) for t in value)
    raise TypeError(f"a pipeline stage must output a tensor or a tuple of tensors, got {type(value).__name__}"
                    + (f" of {[type(t).__name__ for t in value]}" if isinstance(value, (tuple, list)) else ""))


def encode(meta: Meta) -> torch.Tensor:
    is_tuple, items = meta
    flat = [int(is_tuple), len(items)]
    for shape, dtype in items:
        if dtype not in DTYPES:
            raise TypeError(f"pipeline stages cannot send tensors of dtype {dtype}; use one of {DTYPES}")
        flat += [DTYPES.index(dtype), len(shape), *shape]
    if len(flat) > HEADER_LEN:
        raise ValueError(f"a stage output with {len(items)} tensors does not fit the {HEADER_LEN}-entry header")
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
    """Sends and receives of one rank on the pp axis; remembers the shapes learnt from headers."""

    def __init__(self, axis: Axis, device: torch.device):
        self.axis, self.device = axis, device
        self.sent: dict[int, Meta] = {}  # sending stage -> what it sends
        self.known: dict[int, Meta] = {}  # receiving stage -> what it receives
        self.in_flight: list[tuple[comm.Handle, list[torch.Tensor]]] = []  # sends not known to be done

    def post(self, sends: list[tuple[int, object, int, bool]], recvs: list[tuple[int, int, Meta | None]]) -> list:
        """Post one batch. `sends`: (stage, value, peer pp rank, is_activation); `recvs`: (receiving stage,
        peer pp rank, meta or None to read it from a header). Returns one Incoming per receive, in order."""
        for stage, value, peer, activation in sends:  # in action order: messages between two ranks match by order
            if activation:
                meta = describe(value)
                if stage not in self.sent:
                    self.sent[stage] = meta
                    self._send([(encode(meta).to(self.device), peer)], tag="pp_meta")
                elif self.sent[stage] != meta:
                    raise RuntimeError(f"stage {stage} sent {self.sent[stage][1]} before and now {meta[1]}; a "
                                       f"pipeline stage's output shapes must stay the same between micro-batches")
            self._send([(t.detach().contiguous(), peer) for t in as_tensors(value)], tag="pp")
        self.in_flight = [(h, ts) for h, ts in self.in_flight if not h.is_completed()]
        return [self._receive(stage, peer, meta) for stage, peer, meta in recvs]

    def _send(self, ops: list[tuple[torch.Tensor, int]], tag: str) -> None:
        handles = comm.send_recv(ops, [], self.axis, tag=tag)
        self.in_flight += [(h, [t for t, _ in ops]) for h in handles]  # keep the tensors alive until sent

    def _receive(self, stage: int, peer: int, meta: Meta | None) -> Incoming:
        if meta is None:
            meta = self.known.get(stage)
            if meta is None:
                header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                for h in comm.send_recv([], [(header, peer)], self.axis, tag="pp_meta"):
                    h.wait()
                meta = self.known[stage] = decode(header.cpu())
        is_tuple, items = meta
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in items]
        handles = comm.send_recv([], [(b, peer) for b in buffers], self.axis, tag="pp")
        return Incoming(buffers, handles, is_tuple)

    def wait_sends(self) -> None:
        for h, _ in self.in_flight:
            h.wait()
        self.in_flight = []
