"""The layout records are the parallel model's (`Placements`): written by the step that lays a parameter out,
read through the parallel model, never attributes on the tensor."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.layout.mesh import Axis
from paratrain.layout.placement import Partition, Placement, Placements, Replicate, Shard
from paratrain.parallel.tp import parallelize as tensor_parallelize
from tests.cases import tiny_gpt


def test_records_follow_the_parameter_object_and_a_replacement_takes_them_over():
    placements = Placements()
    a, b = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))
    placements.record(a, "tp", Shard(0, 8))
    placements.record(a, "pp", Partition())
    assert placements.of(a) == Placement((("pp", Partition()), ("tp", Shard(0, 8))))
    assert placements.of(b) == Placement()  # no records: replicated everywhere
    a.data = torch.ones(2)  # a strategy re-points the storage: the records stay
    assert placements.of(a).get("tp") == Shard(0, 8)
    placements.carry(a, b)  # b replaces a in the model (the expert split makes new parameters)
    assert placements.of(b).get("tp") == Shard(0, 8) and placements.of(a) == Placement() and len(placements) == 1
    assert vars(a) == {} and vars(b) == {}  # nothing written on the tensors


def test_the_tensor_parallel_step_records_in_the_placements_it_is_given():
    model = tiny_gpt()
    placements = Placements()
    axis = Axis("tp", (0, 1), 0, group=None)  # enough to split; a forward would communicate
    applied = tensor_parallelize(model, axis, "gpt", placements=placements)
    assert applied.placements is placements
    kinds = {name: placements.of(p).get("tp") for name, p in model.named_parameters()}
    assert kinds["embed.tok.weight"] == Shard(0, 256)  # the vocabulary's rows
    assert kinds["blocks.0.attn.q.weight"] == Shard(0, 32) and kinds["blocks.0.attn.o.weight"] == Shard(1, 32)
    assert kinds["blocks.1.mlp.fc.weight"] == Shard(0, 128) and kinds["blocks.1.mlp.proj.weight"] == Shard(1, 128)
    assert kinds["blocks.0.ln1.weight"] == kinds["embed.pos.weight"] == Replicate()
    assert all(kind is not None for kind in kinds.values())  # every parameter: split or recorded replicated
    assert all(vars(p) == {} for p in model.parameters())  # the layout is not on the tensors


def test_a_meta_parameter_allocated_in_place_keeps_its_records_and_its_gradient_hooks():
    from paratrain.parallel.dp.flat import set_data

    placements, param = Placements(), nn.Parameter(torch.empty(3, device="meta"))
    placements.record(param, "tp", Replicate())
    seen = []
    param.register_hook(lambda grad: grad * 10)  # as the tp sum of a sequence-parallel norm weight
    param.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))  # as a strategy's
    set_data(param, torch.ones(3))  # ZeRO-3 and deferred init allocate meta parameters so
    (param * 2).sum().backward()
    assert placements.of(param).get("tp") == Replicate()
    assert torch.equal(param.grad, torch.full((3,), 20.0)) and torch.equal(seen[0], param.grad)


def test_sequence_parallel_hooks_each_replicated_parameter_once_and_a_replacement_when_asked_again():
    from paratrain.parallel.tp.apply import SumOverTp

    def hooks(param) -> int:
        return sum(isinstance(h, SumOverTp) for h in (param._backward_hooks or {}).values())

    model = tiny_gpt()
    applied = tensor_parallelize(model, Axis("tp", (0, 1), 0, group=None), "gpt", sequence_parallel=True)
    norm = model.blocks[0].ln1
    assert hooks(norm.weight) == 1 and hooks(model.ln_f.bias) == 1  # standalone use is already complete
    assert hooks(model.blocks[0].attn.q.weight) == 0 and hooks(model.embed.pos.weight) == 0  # split / whole sequence
    applied.sum_replicated_gradients()  # what parallelize asks once its later steps have run
    assert hooks(norm.weight) == 1  # not twice
    norm.weight = nn.Parameter(norm.weight.detach().clone())  # a later step replaced it (as expert parallelism does)
    applied.sum_replicated_gradients()
    assert hooks(norm.weight) == 1
