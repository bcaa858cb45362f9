"""The objectives' bad input: each an error naming the field and the fix, raised before any process group
(config) or by every rank alike (the micro-batch, built from the same data on each)."""

from __future__ import annotations

import pytest
import torch

from paratrain.config import load_config
from paratrain.config.errors import ConfigError
from paratrain.data.micro_batch import as_micro_batch
from paratrain.data.preference import CompletionCollator, PreferenceCollator
from paratrain.data.token_layout import MicroBatchError
from paratrain.engine.objective_step import ObjectiveStep
from paratrain.errors import InvalidValueError
from paratrain.objectives import DPO, GRPO, LogProbs, build_objective


def _objective(**section):
    return load_config({"train_batch_size": 4, "objective": section}).objective


@pytest.mark.parametrize(("section", "message"), [
    ({"type": "dpo", "loss_type": "kto"}, r"objective.loss_type 'kto' is not a dpo loss type TRL has that paratrain "
                                          r"builds; choose from \['sigmoid'"),
    ({"type": "dpo", "beta": 0.0}, r"objective.beta must be > 0 for dpo .* TRL's default is 0.1"),
    ({"type": "dpo", "beta": -1.0}, r"objective.beta must be > 0 for dpo"),
    ({"type": "grpo", "loss_type": "sigmoid"}, r"objective.loss_type 'sigmoid' is not a grpo loss type"),
    ({"type": "grpo", "loss_type": ["dapo", "grpo"]}, r"objective.loss_type: grpo takes one loss type"),
    ({"type": "dpo", "loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]},
     r"objective.loss_weights has 1 weights for 2 loss types"),
    ({"loss_type": "sigmoid"}, r"objective.loss_type and objective.beta belong to the dpo and grpo objectives"),
    ({"type": "ppo"}, r"objective.type"),
])
def test_a_bad_objective_section_is_named(section, message):
    with pytest.raises((ConfigError, InvalidValueError), match=message):
        _objective(**section)


def test_trls_defaults():
    dpo, grpo = _objective(type="dpo"), _objective(type="grpo")
    assert (dpo.effective_beta, dpo.loss_types, grpo.effective_beta, grpo.loss_types) == (0.1, ["sigmoid"], 0.0,
                                                                                          ["dapo"])
    assert isinstance(build_objective(dpo), DPO) and isinstance(build_objective(grpo), GRPO)
    assert not build_objective(grpo).uses_reference
    assert build_objective(_objective(type="grpo", beta=0.04)).uses_reference


def test_the_reference_mode():
    dpo = build_objective(_objective(type="dpo"))
    assert ObjectiveStep.reference_mode(dpo, None, has_adapters=True) == "adapters_off"
    assert ObjectiveStep.reference_mode(dpo, None, has_adapters=False) == "initial"
    assert ObjectiveStep.reference_mode(dpo, "batch", has_adapters=False) == "batch"
    assert ObjectiveStep.reference_mode(build_objective(_objective(type="grpo")), None, True) == "none"
    with pytest.raises(InvalidValueError, match=r"objective.reference is \"adapters_off\" but the model has no "
                                                r"adapters: add a `peft` section"):
        ObjectiveStep.reference_mode(dpo, "adapters_off", has_adapters=False)


def test_bad_preference_data_is_named():
    collate = PreferenceCollator(pad_token_id=0, pad_to=8)
    with pytest.raises(InvalidValueError, match=r"a preference example needs `chosen_ids` \(token ids\); got keys "
                                                r"\['prompt_ids', 'rejected_ids'\]"):
        collate([{"prompt_ids": [1, 2], "rejected_ids": [3]}])
    with pytest.raises(InvalidValueError, match=r"a prompt with its completion of 9 tokens is longer than the "
                                                r"collator's pad_to=8: raise data.seq_len or truncate the rows"):
        collate([{"prompt_ids": [1] * 5, "chosen_ids": [2] * 4, "rejected_ids": [3]}])
    batch = collate([{"prompt_ids": [1, 2], "chosen_ids": [3, 4], "rejected_ids": [5]}] * 2)
    odd = {k: v[:3] for k, v in batch.items()}
    with pytest.raises(MicroBatchError, match=r"a preference micro-batch holds the chosen rows, then the rejected rows "
                                              r"of the same pairs, so an even number of rows; got 3"):
        as_micro_batch((), odd)
    with pytest.raises(MicroBatchError, match=r"ref_chosen_logps without its partner: give both"):
        as_micro_batch((), {**batch, "ref_chosen_logps": torch.zeros(2)})
    with pytest.raises(MicroBatchError, match=r"takes .*; got also \['labels'\]: drop them in the collator"):
        as_micro_batch((), {**batch, "labels": batch["input_ids"]})


def test_a_preference_batch_in_normal_form():
    collate = PreferenceCollator(pad_token_id=0)
    batch = as_micro_batch((), collate([{"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]},
                                        {"prompt_ids": [7, 8], "chosen_ids": [9], "rejected_ids": [10, 11]}]))
    assert batch.form == "preference"
    # a target is the next token where that token is a completion token: TRL's completion log-probs
    assert batch.targets.tolist() == [[-100, -100, 4, 5, -100], [-100, 9, -100, -100, -100],
                                      [-100, -100, 6, -100, -100], [-100, 10, 11, -100, -100]]


def test_bad_completion_data_is_named():
    collate = CompletionCollator(pad_token_id=0)
    batch = collate([{"prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "advantage": 1.0,
                      "old_per_token_logps": [-1.0, -2.0, -3.0]},
                     {"prompt_ids": [6], "completion_ids": [7], "advantage": -1.0, "old_per_token_logps": [-4.0]}])
    normal = as_micro_batch((), batch)
    assert normal.form == "completions" and normal.input_ids.tolist() == [[1, 2, 3, 4, 5], [0, 6, 7, 0, 0]]
    assert normal.targets.tolist() == [[-100, 3, 4, 5, -100], [-100, 7, -100, -100, -100]]
    assert normal.position_ids.tolist()[1][1:3] == [0, 1]  # the left-padded prompt's tokens count from 0
    assert normal.tokens["old_per_token_logps"].tolist() == [[0, -1, -2, -3, 0], [0, -4, 0, 0, 0]]
    with pytest.raises(MicroBatchError, match=r"`advantages` must be a \(2,\) tensor"):
        as_micro_batch((), {k: v for k, v in batch.items() if k != "advantages"})
    with pytest.raises(MicroBatchError, match=r"`old_per_token_logps` must be a \(2, 3\) tensor shaped like "
                                              r"completion_ids"):
        as_micro_batch((), {**batch, "old_per_token_logps": torch.zeros(2, 2)})


def test_an_objective_refuses_the_other_form():
    dpo = build_objective(_objective(type="dpo"))
    batch = as_micro_batch((torch.tensor([[1, 2, 3]]), torch.tensor([[2, 3, -100]])), {})
    lp = LogProbs(torch.zeros(1, 3), batch.targets != -100, None, None)
    with pytest.raises(InvalidValueError, match=r"the dpo objective trains on preference micro-batches .* got a "
                                                r"tokens micro-batch"):
        dpo(batch, lp)
