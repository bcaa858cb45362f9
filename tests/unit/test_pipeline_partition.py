"""Cutting models into stages (one process): partition methods, the GPT split, LayerSpec, config errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from paratrain.api import resolve_config
from paratrain.config import ConfigError
from paratrain.models import gpt_pipeline_module
from paratrain.parallel.pp import LayerSpec, PipelineModule
from paratrain.parallel.pp.partition import PartitionError, balanced_boundaries, parameter_counts
from paratrain.parallel.pp.split import choose_boundaries, split_pipeline
from tests.cases import tiny_gpt


class Heavy(nn.Module):
    """Few parameters, much compute: one small matrix applied many times."""

    def __init__(self, width: int = 32, repeats: int = 48):
        super().__init__()
        self.w = nn.Linear(width, width)
        self.repeats = repeats

    def forward(self, x):
        for _ in range(self.repeats):
            x = torch.tanh(self.w(x))
        return x


def unbalanced_model() -> PipelineModule:
    """A huge, cheap embedding, four expensive small layers and a cheap head."""
    torch.manual_seed(0)
    layers = [nn.Embedding(20_000, 32), Heavy(), Heavy(), Heavy(), Heavy(), nn.Linear(32, 8)]
    return PipelineModule(layers, loss_fn=nn.functional.cross_entropy,
                          example_input=torch.randint(0, 20_000, (64,)))


def test_parameters_and_balanced_give_different_sensible_splits(monkeypatch):
    """The choice from given layer times (injected: a measured time depends on how busy the machine is, so no
    test asserts on one); the measurement itself is the next test."""
    import paratrain.parallel.pp.split as split

    model = unbalanced_model()
    counts = parameter_counts(model.specs)
    assert counts == [640_000, 1056, 1056, 1056, 1056, 264]
    monkeypatch.setattr(split, "profile_layer_costs", lambda layers, example: [0.1, 1.0, 1.0, 1.0, 1.0, 0.05])
    by_params, _ = choose_boundaries(model, "parameters", 2)
    by_time, _ = choose_boundaries(model, "balanced", 2)
    assert by_params == [0, 1, 6]  # the embedding alone holds 99% of the parameters
    assert by_time == [0, 3, 6]  # embedding + 2 heavy layers | 2 heavy layers + head: equal time
    monkeypatch.setattr(split, "profile_layer_costs", lambda layers, example: [3.0, 1.0, 1.0, 1.0, 1.0, 0.05])
    assert choose_boundaries(model, "balanced", 2)[0] == [0, 2, 6]  # a slow embedding moves the cut
    assert choose_boundaries(model, "uniform", 2)[0] == [0, 3, 6]
    assert choose_boundaries(model, [0, 2, 6], 2) == ([0, 2, 6], "manual")


def test_the_profile_times_every_layer_forward_and_backward_once_per_repeat():
    from paratrain.parallel.pp.partition import profile_layer_costs

    calls = []

    class Counted(nn.Linear):
        def forward(self, x):
            calls.append(self)
            return super().forward(x)

    layers = [Counted(4, 4), Counted(4, 4), Counted(4, 2)]
    backwards = []
    for layer in layers:
        layer.register_full_backward_hook(lambda module, *_: backwards.append(module))
    costs = profile_layer_costs(layers, torch.randn(3, 4), repeats=3)
    assert len(costs) == 3 and all(c > 0 and c == c for c in costs)  # one positive, finite time per layer
    assert [calls.count(layer) for layer in layers] == [4, 4, 4]  # one warm-up + 3 timed runs each
    assert [backwards.count(layer) for layer in layers] == [4, 4, 4]  # and a backward with each
    assert all(p.grad is None for layer in layers for p in layer.parameters())  # left as it found them


def test_balanced_boundaries_minimize_the_heaviest_stage_then_even_out():
    bounds = balanced_boundaries([1] * 10, 4)
    assert sorted(b - a for a, b in zip(bounds, bounds[1:])) == [2, 2, 3, 3]  # not 3, 3, 3, 1
    assert balanced_boundaries([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert balanced_boundaries([1, 1, 1, 1, 4], 3) == [0, 2, 4, 5]


def test_partition_errors_name_the_numbers():
    model = unbalanced_model()
    with pytest.raises(PartitionError, match="8 stages, but the model has only 6 layers"):
        choose_boundaries(model, "uniform", 8)
    with pytest.raises(PartitionError, match=r"pipeline.partition \[0, 4, 3, 6\] must list the stage boundaries: "
                                             r"4 strictly increasing numbers from 0 to the number of layers \(6\)"):
        choose_boundaries(model, [0, 4, 3, 6], 3)
    with pytest.raises(PartitionError, match="unknown pipeline.partition 'type:Heavy'"):
        choose_boundaries(model, "type:Heavy", 2)
    no_example = PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)])
    with pytest.raises(PartitionError, match="pass PipelineModule\\(..., example_input=...\\)"):
        choose_boundaries(no_example, "balanced", 2)


def test_gpt_split_is_the_same_function_and_keeps_names():
    model = tiny_gpt(n_layer=2)
    pipe = gpt_pipeline_module(model)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    assert torch.equal(pipe(x, y), model(x, y))
    assert len(pipe) == 4
    names = [pipe.original_name(i, k) for i in range(len(pipe)) for k in pipe.layer_state_keys(i)]
    assert names == list(model.state_dict().keys())


def test_split_keeps_only_this_ranks_layers_and_builds_layerspecs_there():
    torch.manual_seed(0)
    pipe = PipelineModule([nn.Linear(4, 4), LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4),
                           lambda x: x * 2], partition="uniform")
    mesh = SimpleNamespace(local_rank=lambda axis: 1)  # pp rank 1 of 2: layers 2 and 3
    split = split_pipeline(pipe, mesh, stages=2, virtual=1, partition="parameters")
    assert split.bounds == [0, 2, 4] and split.method == "uniform"  # the module's own partition wins
    assert pipe.specs[0].weight.device.type == "meta"  # another stage's layer: freed
    assert isinstance(pipe.specs[1], LayerSpec)  # another stage's spec: never built
    assert isinstance(pipe.specs[2], nn.Linear) and pipe.specs[2].weight.device.type == "cpu"
    assert [type(m).__name__ for m in split.module.chunks[0].layers] == ["Linear", "FunctionLayer"]


def _resolve(pipeline: dict, **batch):
    return resolve_config({"train_micro_batch_size_per_gpu": 2, **batch, "pipeline": pipeline}, 4)


def test_pipeline_config_batch_arithmetic():
    cfg = _resolve({"stages": 2, "micro_batches": 8})
    assert cfg.gradient_accumulation_steps == 8 and cfg.train_batch_size == 2 * 8 * 2
    cfg = _resolve({"stages": 4}, gradient_accumulation_steps=4)
    assert cfg.pipeline.micro_batches == 4 and cfg.dp_size(4) == 1
    with pytest.raises(ConfigError, match=r"pipeline.micro_batches \(8\) and gradient_accumulation_steps \(4\) "
                                          r"disagree"):
        _resolve({"stages": 2, "micro_batches": 8}, gradient_accumulation_steps=4)
    with pytest.raises(ConfigError, match=r"train_batch_size = .* but 24 != 2 x 8 x 2 = 32"):
        _resolve({"stages": 2, "micro_batches": 8}, train_batch_size=24)
    with pytest.raises(ConfigError, match=r"config section 'pipeline': .*micro-batches \(6\) must be a multiple of "
                                          r"stages \(4\)"):
        _resolve({"stages": 4, "schedule": "interleaved", "virtual_stages": 2}, gradient_accumulation_steps=6)
    with pytest.raises(ConfigError, match="virtual_stages = 2 needs schedule 'interleaved'"):
        _resolve({"stages": 2, "virtual_stages": 2}, gradient_accumulation_steps=4)


def test_v_chunks_balance_each_rank_against_brute_force():
    import itertools
    import random

    from paratrain.parallel.pp.v_partition import rank_loads, v_balanced_boundaries

    # the 6-block benchmark GPT by parameters: chunk-by-chunk balance gives rank 0 two blocks and rank 1 four
    weights = [0.1] + [1.0] * 6 + [0.1]
    chunkwise = balanced_boundaries(weights, 4)
    assert rank_loads(weights, chunkwise) == pytest.approx([2.2, 4.0])
    assert v_balanced_boundaries(weights, 2) == [0, 2, 3, 5, 8]  # 3 blocks each, chunks as even as that allows
    rng = random.Random(0)
    for _ in range(300):  # the heaviest rank is the smallest any cut gives
        p = rng.choice([1, 2, 3])
        weights = [rng.choice([0.1, 0.5, 1.0, 2.0, 3.0]) for _ in range(rng.randint(2 * p, 10))]
        bounds = v_balanced_boundaries(weights, p)
        assert bounds[0] == 0 and bounds[-1] == len(weights) and all(a < b for a, b in zip(bounds, bounds[1:]))
        best = min(max(rank_loads(weights, [0, *cuts, len(weights)]))
                   for cuts in itertools.combinations(range(1, len(weights)), 2 * p - 1))
        assert max(rank_loads(weights, bounds)) == pytest.approx(best, rel=1e-9), (weights, p, bounds)
    with pytest.raises(PartitionError, match="cannot cut 3 layers into the 4 chunks of a V over 2 ranks"):
        v_balanced_boundaries([1.0] * 3, 2)


def _table_v_boundaries(weights, p):
    """The V cut as it was first written: the same dynamic program over every middle (i, j) of every level,
    bottom-up with numpy. `v_balanced_boundaries` now solves it on demand and skips candidates that cannot win;
    the cuts must not change (the engine's V stages and the planner's blocks per rank depend on them)."""
    import numpy as np

    n = len(weights)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=np.float64))])
    size, inf = n + 1, np.inf
    best_b, best_s = np.full((size, size), inf), np.full((size, size), inf)
    for i in range(size):
        for j in range(i + 2, size):
            left = prefix[i + 1:j] - prefix[i]
            best_b[i, j] = prefix[j] - prefix[i]
            best_s[i, j] = float((left * left + (best_b[i, j] - left) ** 2).min())
    choices: list[dict] = [{} for _ in range(p - 1)]
    for r in range(p - 2, -1, -1):
        need = 2 * (p - 1 - r)
        new_b, new_s = np.full((size, size), inf), np.full((size, size), inf)
        for i in range(size):
            for j in range(i + 2 + need, size):
                a, b = np.arange(i + 1, j - need), np.arange(i + 1 + need, j)
                first, last = (prefix[a] - prefix[i])[:, None], (prefix[j] - prefix[b])[None, :]
                inner_b, inner_s = best_b[np.ix_(a, b)], best_s[np.ix_(a, b)]
                valid = (b[None, :] - a[:, None] >= need) & np.isfinite(inner_b)
                cand_b = np.where(valid, np.maximum(first + last, inner_b), inf)
                cand_s = np.where(valid, inner_s + first * first + last * last, inf)
                top = cand_b.min()
                if np.isfinite(top):
                    ties = cand_b <= top + 1e-9 * max(1.0, abs(top))
                    x, y = divmod(int(np.where(ties, cand_s, inf).argmin()), len(b))
                    new_b[i, j], new_s[i, j] = top, cand_s[x, y]
                    choices[r][(i, j)] = (int(a[x]), int(b[y]))
        best_b, best_s = new_b, new_s
    bounds, (i, j) = [0] * (2 * p) + [n], (0, n)
    for r in range(p - 1):
        bounds[r + 1], bounds[2 * p - 1 - r] = i, j = choices[r][(i, j)]
    bounds[p] = min(range(i + 1, j), key=lambda k: ((prefix[k] - prefix[i]) ** 2 + (prefix[j] - prefix[k]) ** 2, k))
    return bounds


def test_v_cut_is_the_table_dynamic_programs_cut():
    import random

    from paratrain.parallel.pp.v_partition import v_balanced_boundaries

    rng = random.Random(0)
    for n in range(2, 17):
        for p in range(1, n // 2 + 1):
            for weights in ([1.0] * n, [0.3] + [1.0] * (n - 2) + [0.7], [float(rng.randint(0, 4)) for _ in range(n)],
                            [rng.random() for _ in range(n)]):
                assert v_balanced_boundaries(weights, p) == _table_v_boundaries(weights, p), (weights, p)


def test_the_parameter_partition_counts_frozen_weights():
    """A LoRA model balances on its base: a frozen weight costs its layer the same forward and input gradient."""
    from paratrain.parallel.pp.partition import parameter_counts

    frozen, trained = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
    frozen.requires_grad_(False)
    assert parameter_counts([frozen, trained]) == [72, 18]


def test_the_parameter_partition_counts_a_4bit_weight_by_its_values():
    """A QLoRA layer costs what its values cost: a 4-bit weight of 64 x 128 counts 8,192, not its 4,096 packed bytes."""
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(128, 64, bias=True, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 128), requires_grad=False, quant_type="nf4").to("cpu")
    assert layer.weight.numel() == 4096
    assert parameter_counts([layer, torch.nn.Linear(8, 2)]) == [64 * 128 + 64, 18]
