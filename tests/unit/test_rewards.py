"""Reward functions and group advantages (`paratrain.rl`): TRL's signature, names and arithmetic, and every bad
reward an error naming the function."""

from __future__ import annotations

import math

import pytest
import torch

from paratrain.errors import InvalidValueError
from paratrain.layout.mesh import Axis
from paratrain.rl import RewardError, RewardFunctions, group_advantages, load_reward_function

ONE = Axis("dp", (0,), 0, None)


def _length(prompts, completions, completion_ids, **columns):
    return [float(len(ids)) for ids in completion_ids]


def _matches(prompts, completions, answer, **columns):
    return [1.0 if c.strip() == a else 0.0 if a else None for c, a in zip(completions, answer)]


def test_rewards_take_trls_arguments_and_extra_columns_and_none_is_nan():
    functions = RewardFunctions([_length, _matches], weights=[0.5, 2.0])
    rewards = functions.score(["1+1=", "2+2=", "3+3="], ["2", " 5", "6"], [[1], [2, 3], [4]],
                              {"answer": ["2", "4", ""]}, ONE)
    assert functions.names == ["_length", "_matches"]
    assert rewards[:, 0].tolist() == [1.0, 2.0, 1.0]
    assert rewards[:2, 1].tolist() == [1.0, 0.0] and math.isnan(float(rewards[2, 1]))


@pytest.mark.parametrize("bad, says", [
    (lambda **kw: 1 / 0, "raised ZeroDivisionError"),
    (lambda prompts, **kw: [0.0] * (len(prompts) + 1), "returned 3 rewards for 2 completions"),
    (lambda prompts, **kw: [0.0, float("nan")], "returned nan for completion 1"),
    (lambda prompts, **kw: None, "returned None for 2 completions"),
])
def test_a_bad_reward_is_an_error_naming_the_function(bad, says):
    bad.__name__ = "broken"
    with pytest.raises(RewardError) as error:
        RewardFunctions([_length, bad]).score(["a", "b"], ["c", "d"], [[1], [2]], {}, ONE)
    assert "'broken'" in str(error.value) and says in str(error.value) and "trainer.reward_funcs" in str(error.value)


def test_reward_functions_are_named_by_file_or_module(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def ok(prompts, completions, **kw):\n    return [1.0] * len(prompts)\n")
    assert load_reward_function(f"{tmp_path}/my_rewards.py:ok")(prompts=["a"], completions=["b"]) == [1.0]
    assert load_reward_function("math:sqrt") is math.sqrt
    for name, says in [("nocolon", "does not name a function"), (f"{tmp_path}/missing.py:f", "no file"),
                       ("no_such_module_x:f", "cannot be imported"), ("math:no_such", "has no function")]:
        with pytest.raises(InvalidValueError, match=says):
            load_reward_function(name)
    with pytest.raises(InvalidValueError, match="one weight per function"):
        RewardFunctions([_length], weights=[1.0, 2.0])


def test_group_advantages_are_trls():
    from trl.trainer.utils import nanstd as trl_nanstd

    nan = float("nan")
    per_function = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, nan], [1.0, 1.0],  # group 0
                                 [2.0, 2.0], [2.0, 2.0], [nan, nan], [2.0, 2.0]])  # group 1: equal, one unscored
    weights = torch.tensor([1.0, 0.5])
    out = group_advantages(per_function, weights, ["a", "b"], num_generations=4, scale_rewards="group")
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.5, 3.0, 3.0, nan, 3.0])
    assert torch.equal(out.rewards.isnan(), rewards.isnan())
    assert torch.allclose(out.rewards.nan_to_num(), rewards.nan_to_num())
    group0 = rewards[:4]
    want = (group0 - group0.mean()) / (trl_nanstd(group0) + 1e-4)
    assert torch.allclose(out.advantages[:4], want, atol=1e-6), (out.advantages, want)
    assert out.advantages[4:].tolist() == [0.0, 0.0, 0.0, 0.0]  # equal rewards: 0; unscored: 0
    assert out.metrics["frac_reward_zero_std"] == 0.5
    assert out.metrics["reward"] == pytest.approx(float(torch.nanmean(rewards)))
    assert out.metrics["rewards/b/mean"] == pytest.approx(float(torch.nanmean(per_function[:, 1])))
    batch = group_advantages(per_function, weights, ["a", "b"], 4, "batch").advantages
    assert torch.allclose(batch[:4], (group0 - group0.mean()) / (trl_nanstd(rewards) + 1e-4), atol=1e-6)
    none = group_advantages(per_function, weights, ["a", "b"], 4, "none").advantages
    assert torch.allclose(none[:4], group0 - group0.mean())
    with pytest.raises(InvalidValueError, match="num_generations"):
        group_advantages(per_function, weights, ["a", "b"], 3)
    with pytest.raises(InvalidValueError, match="scale_rewards"):
        group_advantages(per_function, weights, ["a", "b"], 4, "mean")
