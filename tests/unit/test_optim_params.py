"""optimizer.params and scheduler.params checked by name and type when the config is read (before any
process group exists), with errors that name the key."""

import inspect

import pytest
import torch

from paratrain.config import Config, ConfigError, OptimizerConfig, SchedulerConfig, load_config
from paratrain.config.params import DEEPSPEED_SCHEDULE_PARAMS
from paratrain.optim import DEEPSPEED_SCHEDULES, build_optimizer, build_scheduler


def _optimizer_error(kind: str, params: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({"optimizer": {"type": kind, "params": params}})
    return str(info.value)


def _scheduler_error(kind: str, params: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
                     "scheduler": {"type": kind, "params": params}})
    return str(info.value)


@pytest.mark.parametrize("kind,params,message", [
    ("AdamW", {"lr": "fast"}, "optimizer.params.lr must be a non-negative number, got 'fast'"),
    ("AdamW", {"lr": -0.1}, "optimizer.params.lr must be a non-negative number, got -0.1"),
    ("Adam", {"eps": [1e-8]}, "optimizer.params.eps must be a non-negative number, got [1e-08]"),
    ("AdamW", {"weight_decay": True}, "optimizer.params.weight_decay must be a non-negative number, got True"),
    ("AdamW", {"betas": [0.9]}, "optimizer.params.betas must be a pair of numbers in [0, 1), got [0.9]"),
    ("AdamW", {"betas": [0.9, 1.0]}, "optimizer.params.betas must be a pair of numbers in [0, 1), got [0.9, 1.0]"),
    ("AdamW", {"betas": "0.9,0.99"}, "optimizer.params.betas must be a pair of numbers in [0, 1), got '0.9,0.99'"),
    ("AdamW", {"amsgrad": "yes"}, "optimizer.params.amsgrad must be true or false, got 'yes'"),
    ("AdamW", {"fused": 1}, "optimizer.params.fused must be true, false or null, got 1"),
    ("Adam", {"adam_w_mode": "false"}, "optimizer.params.adam_w_mode must be true or false, got 'false'"),
    ("AdamW", {"torch_adam": 1}, "optimizer.params.torch_adam must be true or false, got 1"),
    ("SGD", {"lr": 0.1, "momentum": "0.9"}, "optimizer.params.momentum must be a non-negative number, got '0.9'"),
    ("SGD", {"lr": 0.1, "nesterov": None}, "optimizer.params.nesterov must be true or false, got None"),
    ("Adagrad", {"lr_decay": "slow"}, "optimizer.params.lr_decay must be a number, got 'slow'"),
    ("Rprop", {"etas": [0.5]}, "optimizer.params.etas must be a list of 2 numbers, got [0.5]"),
    ("LBFGS", {"history_size": 10.5}, "optimizer.params.history_size must be an integer, got 10.5"),
    ("LBFGS", {"line_search_fn": 3}, "optimizer.params.line_search_fn must be a string or null, got 3"),
])
def test_optimizer_param_of_the_wrong_type_is_named(kind, params, message):
    assert _optimizer_error(kind, params) == message


@pytest.mark.parametrize("kind,params,message", [
    ("WarmupLR", {"warmup_num_steps": 10.0}, "scheduler.params.warmup_num_steps must be a positive integer, got 10.0"),
    ("WarmupLR", {"warmup_num_steps": -5}, "scheduler.params.warmup_num_steps must be a positive integer, got -5"),
    ("WarmupLR", {"warmup_num_steps": True}, "scheduler.params.warmup_num_steps must be a positive integer, got True"),
    ("WarmupLR", {"warmup_max_lr": "0.1"}, "scheduler.params.warmup_max_lr must be a number or null, got '0.1'"),
    ("WarmupLR", {"warmup_type": "cosine"}, "scheduler.params.warmup_type must be 'log' or 'linear', got 'cosine'"),
    ("WarmupDecayLR", {"total_num_steps": "100"},
     "scheduler.params.total_num_steps must be a positive integer, got '100'"),
    ("WarmupDecayLR", {"warmup_num_steps": 5},
     "scheduler.params.total_num_steps is required by WarmupDecayLR; set it in 'scheduler.params'"),
    ("WarmupCosineLR", {"total_num_steps": 10, "cos_min_ratio": [0.1]},
     "scheduler.params.cos_min_ratio must be a number, got [0.1]"),
    ("WarmupCosineLR", {"total_num_steps": 10, "last_batch_iteration": 0.5},
     "scheduler.params.last_batch_iteration must be an integer, got 0.5"),
    ("StepLR", {"step_size": "2"}, "scheduler.params.step_size must be an integer, got '2'"),
    ("StepLR", {"gamma": 0.5}, "scheduler.params.step_size is required by StepLR; set it in 'scheduler.params'"),
    ("ReduceLROnPlateau", {"mode": "lowest"}, "scheduler.params.mode must be 'min' or 'max', got 'lowest'"),
])
def test_scheduler_param_of_the_wrong_type_is_named(kind, params, message):
    assert _scheduler_error(kind, params) == message


def test_unknown_param_names_get_a_did_you_mean():
    assert _optimizer_error("AdamW", {"lrr": 0.1}) == \
        "unknown config key 'optimizer.params.lrr' for AdamW; did you mean 'optimizer.params.lr'?"
    assert _optimizer_error("Adam", {"beta": [0.9, 0.99]}) == \
        "unknown config key 'optimizer.params.beta' for AdamW (Adam); did you mean 'optimizer.params.betas'?"
    assert _scheduler_error("WarmupLR", {"warmup_steps": 10}) == \
        ("unknown config key 'scheduler.params.warmup_steps' for WarmupLR; "
         "did you mean 'scheduler.params.warmup_num_steps'?")
    assert _scheduler_error("WarmupLR", {"zzz": 1}) == (
        "unknown config key 'scheduler.params.zzz' for WarmupLR; WarmupLR takes: warmup_min_lr, warmup_max_lr, "
        "warmup_num_steps, warmup_type, last_batch_iteration")


def test_unknown_types_fail_when_the_config_is_read():
    assert _optimizer_error("Adamm", {}).startswith("config key 'optimizer.type' = 'Adamm' is not an optimizer")
    assert "OneCycle and LRRangeTest are not implemented" in _scheduler_error("OneCycle", {})


def test_good_params_pass_and_build():
    config = load_config({
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 0,
                                                 "adam_w_mode": False, "torch_adam": True, "fused": None}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_max_lr": None,
                                                          "warmup_num_steps": 2, "warmup_type": "linear"}}})
    optimizer = build_optimizer(config.optimizer, [torch.nn.Parameter(torch.ones(2))])
    assert type(optimizer) is torch.optim.Adam and optimizer.defaults["betas"] == (0.8, 0.999)
    assert build_scheduler(config.scheduler, optimizer).total_num_steps == 10
    load_config({"optimizer": {"type": "SGD", "params": {"lr": torch.tensor(0.1), "momentum": 0, "nesterov": False}}})


def test_a_config_object_and_a_direct_build_are_checked_too():
    config = Config(optimizer=OptimizerConfig(type="AdamW", params={"lr": "fast"}))
    with pytest.raises(ConfigError, match=r"^optimizer.params.lr must be a non-negative number, got 'fast'$"):
        load_config(config)
    with pytest.raises(ConfigError, match=r"^optimizer.params.lr must be a non-negative number, got 'fast'$"):
        build_optimizer(config.optimizer, [torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ConfigError, match=r"^scheduler.params.warmup_type must be 'log' or 'linear', got 'cos'$"):
        build_scheduler(SchedulerConfig(type="WarmupLR", params={"warmup_type": "cos"}), None)


@pytest.mark.parametrize("name", sorted(DEEPSPEED_SCHEDULES))
def test_deepspeed_schedule_tables_match_the_classes(name):
    """The config checks paratrain.optim's schedules from a table (config sits below optim): keep them equal."""
    kinds, required = DEEPSPEED_SCHEDULE_PARAMS[name]
    parameters = list(inspect.signature(DEEPSPEED_SCHEDULES[name].__init__).parameters.values())[2:]
    assert list(kinds) == [p.name for p in parameters]
    assert set(required) == {p.name for p in parameters if p.default is p.empty}


def test_initialize_refuses_before_any_process_group_exists(monkeypatch):
    import paratrain
    import paratrain.api

    started = []
    monkeypatch.setattr(paratrain.api, "init_distributed", lambda **kwargs: started.append(kwargs))
    with pytest.raises(ConfigError, match=r"^optimizer.params.lr must be a non-negative number, got 'fast'$"):
        paratrain.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 1, "optimizer": {
            "type": "AdamW", "params": {"lr": "fast"}}})
    assert started == []  # the error came before init_distributed, so before any collective
