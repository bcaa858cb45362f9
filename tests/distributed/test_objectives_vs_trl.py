"""The one-process references of tests/objective_cases.py, and paratrain's engine on one process, equal TRL 1.16's own
`DPOTrainer.compute_loss` and `GRPOTrainer.compute_loss` on the same batches (TRL is a dev dependency, a peer in the
tests, never paratrain's runtime).

The model is a tiny random transformers Llama (initializer_range 0.2, so the log-probs are far from uniform); the
batches are 8 preference pairs and 8 completions of different lengths collated by paratrain's collators (TRL's
collated forms: chosen rows then rejected, right-padded; prompts left-padded). paratrain's engine first takes one
AdamW step on the batch, so the policy leaves its reference (the initial model). At that policy, for every case:
- TRL's trainer (fp32, one process) computes the loss of the batch on a copy of the policy: DPO with the initial
  model as `ref_model`; GRPO with the reference TRL itself loads from the initial model's directory and its own
  `ref_per_token_logps`, and rollout log-probs (`old_per_token_logps`) that differ from the current ones, so the clip
  acts (asserted);
- the plain reference (`dpo_loss`: sigmoid, ipo, hinge, robust; `grpo_loss`: all) computes it from every row's real
  tokens alone;
- the engine's next `train_batch` returns it, and `objective_metrics()` its metrics, which must equal TRL's logged
  ones (rewards/*, logps/* for DPO; clip_ratio/*, kl, entropy for GRPO).
Each within 1e-5 (relative). DPO: sigmoid, ipo, hinge, robust, sigmoid_norm, exo_pair, nca_pair, bco_pair,
sppo_hard, apo_zero, apo_down and a weighted sum of three (`loss_weights`); GRPO: dapo, grpo, dr_grpo, bnpo with
beta 0, and dapo, grpo, dr_grpo with beta 0.04 (epsilon 0.2, epsilon_high 0.28).

Normalisation: with one micro-batch, no accumulation and one process, TRL's loss is ours exactly. Over several
micro-batches or processes they differ by design: TRL's grpo, bnpo and dr_grpo losses are means over each micro-batch
(grpo: of its completions' per-token means; bnpo: over its tokens; dr_grpo: its completions x max_completion_length)
divided by the accumulation steps, its dapo divides by the generation batch's token count rescaled per process and
accumulation step, and its DPO loss is each micro-batch's mean over its pairs; paratrain divides every objective once
by the count of the optimizer step's whole batch (tokens, completions or pairs over dp x cp x accumulation).

A whole GRPO step as well (`test_a_grpo_step_equals_trls_trainer_on_the_same_completions`): paratrain's `GRPOStep`
draws the completions, and TRL's `GRPOTrainer.train()`, handed them through its `rollout_func`, does the rest its own
way (rewards, advantages, old and reference log-probs, num_iterations updates with its optimizer).

TRL's settings: bf16=False (TRL's configs default to bf16 autocast, which moves the log-probs by 1e-2 here), use_cpu,
temperature 1.0, use_bias_correction_kl (its default) for beta > 0.
"""

from __future__ import annotations

import copy
import tempfile

import torch

from tests.cases import import_or_skip, tiny_hf
from tests.objective_cases import (
    COMPLETION,
    Completions,
    PreferencePairs,
    completion_collator,
    dpo_loss,
    frozen,
    grpo_loss,
    preference_collator,
)

import_or_skip("trl")

TOLERANCE = 1e-5
INIT_RANGE = 0.2  # weights 10x the default's: log-probs far from uniform, rewards far from 0
LR = {"dpo": 1e-2, "grpo": 5e-4}  # one AdamW step moves the log-probs: rewards and kl act, the clip holds some tokens
# (loss types, their loss_weights, label_smoothing); the plain reference has the first four, the engine all of them
DPO_CASES = ((["sigmoid"], None, 0.0), (["ipo"], None, 0.0), (["hinge"], None, 0.0), (["robust"], None, 0.1),
             (["sigmoid_norm"], None, 0.0), (["exo_pair"], None, 0.1), (["nca_pair"], None, 0.0),
             (["bco_pair"], None, 0.0), (["sppo_hard"], None, 0.0), (["apo_zero"], None, 0.0),
             (["apo_down"], None, 0.0), (["sigmoid", "ipo", "hinge"], [0.5, 0.01, 2.0], 0.0))
REFERENCE_DPO = ("sigmoid", "ipo", "hinge", "robust")
GRPO_CASES = (("dapo", 0.0), ("grpo", 0.0), ("dr_grpo", 0.0), ("bnpo", 0.0), ("dapo", 0.04), ("grpo", 0.04),
              ("dr_grpo", 0.04))
EPSILON = (0.2, 0.28)
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")
GRPO_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy")


def _model():
    return tiny_hf("llama", initializer_range=INIT_RANGE)


def _stepped_engine(section: dict, batch: dict):
    """paratrain's engine on one process after one AdamW step on `batch`: (engine, the initial model, the policy)."""
    import paratrain

    model = _model()
    initial = frozen(model)
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": LR[section["type"]]}}, "objective": section}
    engine, *_ = paratrain.initialize(model=model, config=config)
    engine.train_batch(iter([batch]))
    policy = _model()
    policy.load_state_dict(engine.full_state_dict())
    return engine, initial, policy.train()


def _trl_args(config_class, output_dir: str, **settings):
    return config_class(output_dir=output_dir, report_to="none", use_cpu=True, bf16=False,
                        per_device_train_batch_size=8, gradient_accumulation_steps=1, save_strategy="no",
                        logging_strategy="no", disable_tqdm=True, **settings)


def _tokenizer():
    from tests.tiny_tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()  # the trainers want one; every batch here is already token ids


def _dpo_case(loss_types: list[str], weights: list[float] | None, smoothing: float, output_dir: str) -> dict:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    batch = preference_collator()(list(PreferencePairs()))
    section = {"type": "dpo", "beta": 0.1, "loss_type": loss_types, "loss_weights": weights,
               "label_smoothing": smoothing}
    engine, initial, policy = _stepped_engine(section, batch)
    reference = None
    if len(loss_types) == 1 and loss_types[0] in REFERENCE_DPO:
        with torch.no_grad():
            reference = float(dpo_loss(policy, initial, batch, loss_types[0], label_smoothing=smoothing))
    args = _trl_args(DPOConfig, output_dir, beta=0.1, loss_type=loss_types, loss_weights=weights,
                     label_smoothing=smoothing, precompute_ref_log_probs=False)
    trainer = DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(initial), args=args,
                         train_dataset=Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}]),
                         processing_class=_tokenizer())
    trl_loss = trainer.compute_loss(trainer.model, dict(batch)).item()
    trl_metrics = {name: trainer._metrics["train"][name][-1] for name in DPO_METRICS}
    loss = float(engine.train_batch(iter([batch])))  # at the policy: the metrics are the step's, before it
    name = "+".join(loss_types) + (f" weights {weights}" if weights else "") + \
        (f" label_smoothing {smoothing}" if smoothing else "")
    return {"case": f"dpo {name}", "trl": trl_loss,
            "reference": reference, "engine": loss, "trl_metrics": trl_metrics,
            "engine_metrics": engine.objective_metrics()}


def _completions(model) -> dict:
    """The GRPO batch: rollout log-probs that are the initial model's plus noise (so the ratio leaves 1 even on the
    first step, and the rollout differs from the reference)."""
    batch = completion_collator()(list(Completions(model)))
    noise = 0.1 * torch.randn(batch["old_per_token_logps"].shape, generator=torch.Generator().manual_seed(3),
                              dtype=torch.float64)
    batch["old_per_token_logps"] = (batch["old_per_token_logps"] + noise) * batch["completion_mask"]
    return batch


def _grpo_case(loss_type: str, beta: float, output_dir: str) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    batch = _completions(_model())
    section = {"type": "grpo", "loss_type": loss_type, "beta": beta, "epsilon": EPSILON[0],
               "epsilon_high": EPSILON[1], "max_completion_length": COMPLETION, "temperature": 1.0}
    engine, initial, policy = _stepped_engine(section, batch)
    with torch.no_grad():
        reference = float(grpo_loss(policy, batch, loss_type, beta, EPSILON, COMPLETION,
                                    reference=initial if beta else None))
    initial.save_pretrained(output_dir)  # TRL loads its reference model from the policy's model id
    trl_policy = copy.deepcopy(policy)
    trl_policy.config._name_or_path = output_dir
    args = _trl_args(GRPOConfig, output_dir, loss_type=loss_type, beta=beta, epsilon=EPSILON[0],
                     epsilon_high=EPSILON[1], max_completion_length=COMPLETION, num_generations=4, temperature=1.0)
    trainer = GRPOTrainer(model=trl_policy, reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
                          args=args, train_dataset=Dataset.from_list([{"prompt": "a"}] * 8),
                          processing_class=_tokenizer())
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # set by Trainer.train
    inputs = {**batch, "advantages": batch["advantages"].float(),
              "old_per_token_logps": batch["old_per_token_logps"].float(),
              "num_items_in_batch": batch["completion_mask"].sum()}
    if beta:  # as TRL's rollout computes them: its reference model's forward on the prompt and completion
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with torch.no_grad():
            inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                trainer.ref_model, ids, mask, COMPLETION)[0]
    trl_loss = trainer.compute_loss(trainer.model, inputs).item()
    names = GRPO_METRICS + (("kl",) if beta else ())
    trl_metrics = {name: trainer._metrics["train"][name][-1] for name in names}
    loss = float(engine.train_batch(iter([batch])))  # the engine's in-step reference: the initial model's copy
    return {"case": f"grpo {loss_type} beta {beta}", "trl": trl_loss, "reference": reference, "engine": loss,
            "trl_metrics": trl_metrics, "engine_metrics": engine.objective_metrics()}


def _all_cases() -> list[dict]:
    out = []
    for loss_types, weights, smoothing in DPO_CASES:
        with tempfile.TemporaryDirectory() as output_dir:
            out.append(_dpo_case(loss_types, weights, smoothing, output_dir))
    for loss_type, beta in GRPO_CASES:
        with tempfile.TemporaryDirectory() as output_dir:
            out.append(_grpo_case(loss_type, beta, output_dir))
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _errors(r: dict) -> tuple[dict, dict]:
    """(relative differences of the losses from TRL's, of the engine's metrics from TRL's: absolute where TRL's is 0)"""
    losses = {"engine": _rel(r["engine"], r["trl"])}
    if r["reference"] is not None:
        losses["reference"] = _rel(r["reference"], r["trl"])
    metrics = {name: _rel(r["engine_metrics"][name], value) if value else abs(r["engine_metrics"][name])
               for name, value in r["trl_metrics"].items()}
    return losses, metrics


def _line(r: dict) -> str:
    losses, metrics = _errors(r)
    compared = ", ".join(f"{name} {err:.1e}" for name, err in losses.items())
    clipped = r["trl_metrics"].get("clip_ratio/region_mean")
    return (f"{r['case']}: TRL loss {r['trl']:.7g}; rel. diff {compared}; metrics max rel. diff "
            f"{max(metrics.values()):.1e}" + (f"; clipped {clipped:.3f}" if clipped is not None else ""))


def test_references_and_engine_equal_trl_dpo_and_grpo(world1):
    """Runs in a rank of its own (paratrain's engine needs a process group; TRL's trainers see a world of one)."""
    results = world1.run(_all_cases)[0]
    print("\n".join(_line(r) for r in results))
    assert len(results) == len(DPO_CASES) + len(GRPO_CASES)
    for r in results:
        losses, metrics = _errors(r)
        assert max(losses.values()) <= TOLERANCE, (r, losses)
        assert max(metrics.values()) <= TOLERANCE, (r, metrics)
        if r["case"].startswith("grpo"):
            assert 0 < r["trl_metrics"]["clip_ratio/region_mean"] < 0.5, r  # the clip acts, on some tokens
            assert "kl" not in r["trl_metrics"] or r["trl_metrics"]["kl"] > 0, r  # the policy left its reference
        else:
            assert abs(r["trl_metrics"]["rewards/margins"]) > 1e-3, r  # the policy left its reference


# A whole GRPO step against TRL's trainer: paratrain's GRPOStep draws the completions; TRL's GRPOTrainer, handed
# those completions through its rollout_func, scores them, computes its advantages, its rollout and reference
# log-probs, and trains num_iterations updates with its own compute_loss and optimizer.
STEP_PROMPTS, STEP_GENERATIONS, STEP_NEW, STEP_STEPS, STEP_WEIGHTS = 2, 3, 5, 2, (1.0, 0.5)
STEP_SETTINGS = {"loss_type": "grpo", "beta": 0.04, "epsilon": EPSILON[0], "num_iterations": 2}
STEP_ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
STEP_EOS = tuple(range(3, 40))  # ids below 40 end a completion: some end early, some run to STEP_NEW


def _even_tokens(prompts, completions, completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def _short(prompts, completions, completion_ids, **kwargs):
    return [-abs(len(ids) - 3.0) for ids in completion_ids]


def _word_tokenizer(vocab: int):
    """Words t0..t{vocab-1} as ids (t0 pad, t2 eos), so TRL can decode any completion paratrain drew."""
    import tokenizers
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2")


def _paratrain_grpo_steps(model, prompt_ids: torch.Tensor, per_generation: int) -> dict:
    import paratrain
    from paratrain.rl import RewardFunctions
    from paratrain.trainer.grpo import GRPOSettings, GRPOStep

    rows = STEP_PROMPTS * STEP_GENERATIONS
    engine, *_ = paratrain.initialize(model=model, config={
        "train_batch_size": rows, "train_micro_batch_size_per_gpu": rows, "gradient_clipping": 1.0,
        "steps_per_print": 10**6, "optimizer": {"type": "AdamW", "params": {**STEP_ADAMW, "betas": list(
            STEP_ADAMW["betas"])}},
        "objective": {"type": "grpo", "max_completion_length": STEP_NEW, "temperature": 1.0,
                      **{k: v for k, v in STEP_SETTINGS.items() if k != "num_iterations"}}})
    step = GRPOStep(engine, RewardFunctions([_even_tokens, _short], weights=list(STEP_WEIGHTS)),
                    GRPOSettings(num_generations=STEP_GENERATIONS, max_completion_length=STEP_NEW,
                                 num_iterations=STEP_SETTINGS["num_iterations"], seed=7, eos_token_id=list(STEP_EOS),
                                 steps_per_generation=per_generation))
    out = {"losses": [], "grad_norms": [], "completions": [], "log_probs": [], "rewards": [], "metrics": []}
    prompts = STEP_PROMPTS * per_generation  # a rollout batch: per_generation optimizer steps' prompts
    for s in range(STEP_STEPS // per_generation):
        index = torch.arange(s * prompts, (s + 1) * prompts)
        result = step(prompt_ids[index], torch.ones_like(prompt_ids[index]), index)
        r = result.rollout
        out["losses"] += result.losses
        out["grad_norms"] += result.grad_norms
        out["completions"] += [ids[m.bool()].tolist() for ids, m in zip(r.completion_ids, r.completion_mask)]
        out["log_probs"] += [lp[m.bool()].tolist() for lp, m in zip(r.log_probs, r.completion_mask)]
        out["rewards"].append(result.rewards.tolist())
        out["metrics"].append(result.metrics)
    out["state"] = {k: v.clone() for k, v in engine.full_state_dict().items()}
    return out


def _trl_grpo_steps(initial, prompt_ids: torch.Tensor, drawn: dict, output_dir: str, per_generation: int) -> dict:
    """TRL's trainer on the completions paratrain drew (rollout_func), from the same initial weights; with
    steps_per_generation > 1 its shuffle of the rollout batch is off, so its i-th step trains the i-th step's
    prompts as paratrain's does."""
    import os
    from unittest import mock

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func is experimental in TRL 1.16
    served: dict[int, int] = {}  # prompt -> completions handed out so far (its generation index)

    def rollout_func(prompts, trainer):
        rows = []
        for text in prompts:
            prompt = int(text[1:])
            generation = served.get(prompt, 0) % STEP_GENERATIONS
            served[prompt] = generation + 1
            rows.append(prompt * STEP_GENERATIONS + generation)
        return {"prompt_ids": [prompt_ids[r // STEP_GENERATIONS].tolist() for r in rows],
                "completion_ids": [drawn["completions"][r] for r in rows],
                "logprobs": [drawn["log_probs"][r] for r in rows]}

    states = []

    class Weights(TrainerCallback):
        def on_train_end(self, args, state, control, model=None, **kwargs):
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    initial.save_pretrained(output_dir)  # TRL loads its reference model from the policy's model id
    policy = copy.deepcopy(initial).train()
    policy.config._name_or_path = output_dir
    rows = STEP_PROMPTS * STEP_GENERATIONS
    args = GRPOConfig(
        output_dir=output_dir, report_to="none", use_cpu=True, bf16=False, per_device_train_batch_size=rows,
        gradient_accumulation_steps=1, steps_per_generation=per_generation, num_generations=STEP_GENERATIONS,
        max_completion_length=STEP_NEW, temperature=1.0, reward_weights=list(STEP_WEIGHTS),
        max_steps=STEP_STEPS * STEP_SETTINGS["num_iterations"], learning_rate=STEP_ADAMW["lr"],
        adam_beta1=STEP_ADAMW["betas"][0], adam_beta2=STEP_ADAMW["betas"][1], adam_epsilon=STEP_ADAMW["eps"],
        weight_decay=STEP_ADAMW["weight_decay"], optim="adamw_torch", max_grad_norm=1.0, lr_scheduler_type="constant",
        warmup_steps=0, shuffle_dataset=False, logging_strategy="steps", logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, **STEP_SETTINGS)
    trainer = GRPOTrainer(model=policy, reward_funcs=[_even_tokens, _short], args=args,
                          train_dataset=Dataset.from_list([{"prompt": f"p{i}"} for i in range(len(prompt_ids))]),
                          processing_class=_word_tokenizer(initial.config.vocab_size), rollout_func=rollout_func,
                          callbacks=[Weights()])
    with mock.patch("trl.trainer.grpo_trainer.shuffle_sequence_dict", lambda batch: batch):
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": [e["loss"] for e in logs], "grad_norms": [e["grad_norm"] for e in logs],
            "logs": logs, "state": states[0]}


def _whole_grpo_step_cases() -> list[dict]:
    out = []
    for per_generation in (1, 2):  # steps_per_generation: a rollout batch of one optimizer step's prompts, or two
        model = _model()
        initial = copy.deepcopy(model)
        prompt_ids = torch.randint(40, model.config.vocab_size, (STEP_PROMPTS * STEP_STEPS, 6),
                                   generator=torch.Generator().manual_seed(2))
        ours = _paratrain_grpo_steps(model, prompt_ids, per_generation)
        with tempfile.TemporaryDirectory() as output_dir:
            theirs = _trl_grpo_steps(initial, prompt_ids, ours, output_dir, per_generation)
        out.append({"per_generation": per_generation, "paratrain": ours, "trl": theirs})
    return out


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(_rel(x, y) for x, y in zip(a, b, strict=True))


def test_a_grpo_step_equals_trls_trainer_on_the_same_completions(world1):
    """Two optimizer steps' prompts (2 prompts x 3 generations each, two weighted rewards, grpo loss with beta 0.04,
    num_iterations 2: four AdamW updates, clipped at 1.0), sampled as two rollout batches or, with
    steps_per_generation 2, as one, give TRL's loss and gradient norm at every update, its rewards and its weights
    after, within 1e-5 (the loss: absolute, see below; the rest relative)."""
    for result in world1.run(_whole_grpo_step_cases)[0]:
        ours, theirs, per_generation = result["paratrain"], result["trl"], result["per_generation"]
        lengths = [len(c) for c in ours["completions"]]
        assert min(lengths) < STEP_NEW == max(lengths), lengths  # some completions end early, some are cut
        updates = STEP_STEPS * STEP_SETTINGS["num_iterations"]
        assert len(ours["losses"]) == len(theirs["losses"]) == updates
        loss_error = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"]))
        print(f"\nGRPO step vs TRL, steps_per_generation {per_generation}: loss max abs. diff {loss_error:.1e}, "
              f"grad norm max rel. diff {_max_rel(ours['grad_norms'], theirs['grad_norms']):.1e}")
        # a GRPO loss is a mean of advantage-weighted ratios that cancel within each group (the first update's is 0
        # up to rounding): its error is measured against the terms' scale, 1, not against the near-zero mean
        assert loss_error <= TOLERANCE, (per_generation, ours["losses"], theirs["losses"])
        assert _max_rel(ours["grad_norms"], theirs["grad_norms"]) <= TOLERANCE, \
            (per_generation, ours["grad_norms"], theirs["grad_norms"])
        assert max(ours["grad_norms"]) > 1.0  # the clip acts on some update
        generated = theirs["logs"][::STEP_SETTINGS["num_iterations"] * per_generation]  # where TRL scored them
        assert len(generated) == len(ours["metrics"]) == STEP_STEPS // per_generation
        for metrics, log, rewards in zip(ours["metrics"], generated, ours["rewards"], strict=True):
            for name in ("reward", "reward_std", "rewards/_even_tokens/mean", "rewards/_short/mean",
                         "completions/mean_length"):
                assert abs(metrics[name] - log[name]) <= TOLERANCE * max(1.0, abs(log[name])), (name, metrics, log)
            assert len(set(rewards)) > 1  # the advantages are not all zero
        for name, value in theirs["state"].items():
            scale = value.abs().max().item()
            assert (ours["state"][name] - value).abs().max().item() <= TOLERANCE * scale, (per_generation, name)
