"""Optimizers and DeepSpeed's learning-rate schedules, against their closed forms."""

import math

import pytest
import torch

from paratrain.config import ConfigError, OptimizerConfig, SchedulerConfig
from paratrain.optim import build_optimizer, build_scheduler


def _opt(lr=0.1):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_adam_means_adamw_with_deepspeed_defaults():
    p = [torch.nn.Parameter(torch.zeros(2))]
    opt = build_optimizer(OptimizerConfig(type="Adam", params={"lr": 1e-3}), p)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["weight_decay"] == 0.0
    opt = build_optimizer(OptimizerConfig(type="Adam", params={"lr": 1e-3, "adam_w_mode": False}), p)
    assert type(opt) is torch.optim.Adam
    assert isinstance(build_optimizer(OptimizerConfig(type="Adagrad", params={"lr": 0.1}), p), torch.optim.Adagrad)
    with pytest.raises(ConfigError, match="'optimizer.type' = 'Adamm'"):
        build_optimizer(OptimizerConfig(type="Adamm"), p)


def _lrs(sched, opt, n):
    out = [opt.param_groups[0]["lr"]]
    for _ in range(n):
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def test_warmup_lr_log_and_linear():
    opt = _opt()
    s = build_scheduler(SchedulerConfig(type="WarmupLR", params={"warmup_min_lr": 0.0, "warmup_max_lr": 1.0,
                                                                 "warmup_num_steps": 10}), opt)
    lrs = _lrs(s, opt, 12)
    assert lrs[0] == 0.0  # before the first step DeepSpeed sets min lr
    assert lrs[5] == pytest.approx(math.log(5) / math.log(10))
    assert lrs[11] == 1.0
    opt = _opt()
    s = build_scheduler(SchedulerConfig(type="WarmupLR", params={"warmup_max_lr": 2.0, "warmup_num_steps": 4,
                                                                 "warmup_type": "linear"}), opt)
    assert _lrs(s, opt, 5) == [0.0, 0.0, 0.5, 1.0, 1.5, 2.0]


def test_warmup_decay_lr_reaches_zero():
    opt = _opt()
    s = build_scheduler(SchedulerConfig(type="WarmupDecayLR", params={
        "total_num_steps": 20, "warmup_max_lr": 1.0, "warmup_num_steps": 10, "warmup_type": "linear"}), opt)
    lrs = _lrs(s, opt, 22)  # lrs[i] is the lr after i steps, i.e. at batch iteration i - 1
    assert lrs[11] == pytest.approx(1.0)  # iteration 10: (20 - 10) / 10
    assert lrs[16] == pytest.approx(0.5)
    assert lrs[20] == pytest.approx(0.1) and lrs[21] == 0.0 and lrs[22] == 0.0


def test_warmup_cosine_lr_ratio_of_base():
    opt = _opt(lr=0.5)
    s = build_scheduler(SchedulerConfig(type="WarmupCosineLR", params={
        "total_num_steps": 20, "warmup_num_steps": 4, "warmup_type": "linear", "cos_min_ratio": 0.1}), opt)
    lrs = _lrs(s, opt, 25)
    assert lrs[0] == 0.0 and lrs[3] == pytest.approx(0.5 * 2 / 4)
    mid = 0.1 + 0.9 * (1 + math.cos(math.pi * 9 / 16)) / 2
    assert lrs[13] == pytest.approx(0.5 * mid)  # step 12: progress (12 - 4 + 1) / 16
    assert lrs[-1] == pytest.approx(0.5 * 0.1)


def test_torch_scheduler_by_name_and_unknown():
    opt = _opt()
    s = build_scheduler(SchedulerConfig(type="StepLR", params={"step_size": 1, "gamma": 0.5}), opt)
    s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    with pytest.raises(ConfigError, match="OneCycle and LRRangeTest are not implemented"):
        build_scheduler(SchedulerConfig(type="OneCycle"), opt)


def test_initialize_refuses_groups_that_miss_or_repeat_a_parameter_by_name():
    """Checked against the model before any strategy runs (so on every rank alike, before any collective)."""
    from paratrain.engine.setup import named_param_groups
    from tests.cases import tiny_gpt

    model = tiny_gpt()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2 and n != "blocks.1.ln2.weight"]
    with pytest.raises(ValueError, match=r"1 trainable parameter\(s\) in no group: \['blocks.1.ln2.weight'\]; put "
                                         r"every parameter with requires_grad in a group \(or freeze it"):
        named_param_groups(model, [{"params": matrices}, {"params": rest}])
    with pytest.raises(ValueError, match="parameter 'embed.tok.weight' is in two groups"):
        named_param_groups(model, [{"params": matrices}, {"params": list(model.parameters())}])
    model.blocks[1].ln2.weight.requires_grad_(False)  # a frozen parameter may stay out
    assert [len(g["params"]) for g in named_param_groups(model, [{"params": matrices}, {"params": rest}])] == \
        [len(matrices), len(rest)]
