"""Hugging Face models in every layout with no plan written: each family's tiny random transformers model,
trained by paratrain, against the same model trained in one process by its own forward.

The matrix of the issue: Llama (grouped-query attention, tp = num_key_value_heads) and Qwen2 (q/k/v biases)
under DDP, ZeRO-1/2/3, dp2·tp2 with and without sequence parallelism, dp2·pp2 (1F1B and ZB-H1), dp2·cp2 and
dp2·pp2·tp2; Mistral, GPT-2 (transposed Conv1D layers, packed c_attn, a learned position table) and Phi-3
(packed qkv_proj and gate_up_proj) in dp2·tp2 (with and without SP), pp2 and dp2·pp2·tp2, and more.
One reference per family serves all of its layouts; each world runs all of its cases in one `World.run`.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist

from paratrain.testing.parity import compare, reference_config, run_layout, summarize
from paratrain.testing.reference import reference_run
from tests.cases import STABLE_EPS, corpus_windows, hf_loss, hf_param_groups, import_or_skip, tiny_hf
from tests.distributed.test_hybrid import layout

import_or_skip("transformers")

STEPS = 4


# AdamW eps for these families: 10 x STABLE_EPS (tests/cases.py says why: gradient elements of ~1e-9, whose Adam
# step at a small eps is noise's sign times lr). Phi-3's dp2·tp2·sp reached 1.5e-5 that way at eps 1e-8 on one
# CPU; at STABLE_EPS, on an Intel Xeon, one element of Qwen2's 1,024-element layers.1.self_attn.o_proj moved 9.9e-6
# apart from the reference over 4 steps (the rest <= 3.1e-7): 1.43e-5 for the tensor under dp2·tp2 with and
# without SP. At 1e-5 the worst tensor there is 2.8e-6.
HF_EPS = 10 * STABLE_EPS


def stable(cfg: dict) -> dict:
    """Every family with AdamW eps HF_EPS, one eps for all."""
    return {**cfg, "optimizer": {**cfg["optimizer"], "params": {**cfg["optimizer"]["params"], "eps": HF_EPS}}}


EVERY_LAYOUT_4 = [layout(dp=4), layout(dp=4, zero=1), layout(dp=4, zero=2), layout(dp=4, zero=3, micro_batch=1),
                  layout(dp=2, tp=2), layout(dp=2, tp=2, sp=True), layout(dp=2, pp=2),
                  layout(dp=2, pp=2, schedule="zb-h1"), layout(dp=2, cp=2)]
PACKED_4 = [layout(dp=2, tp=2), layout(dp=2, tp=2, sp=True), layout(dp=2, pp=2), layout(dp=4, zero=3, micro_batch=1),
            layout(dp=2, cp=2)]
MATRIX_4 = [(family, stable(cfg)) for family, cfg in
            [("llama", cfg) for cfg in EVERY_LAYOUT_4] + [("qwen2", cfg) for cfg in EVERY_LAYOUT_4] +
            [("mistral", layout(dp=2, tp=2)), ("mistral", layout(dp=2, pp=2))] +
            [("gpt2", cfg) for cfg in PACKED_4] + [("phi3", cfg) for cfg in PACKED_4] +
            [("llama", layout(dp=2, tp=2, ckpt="full")), ("qwen2", layout(dp=2, cp=2, ckpt="selective")),  # recompute:
             ("phi3", layout(dp=2, pp=2, zero=1, ckpt="full"))]]  # decoder layers (_no_split_modules), attention cores
MATRIX_8 = [(family, stable(layout(dp=2, pp=2, tp=2))) for family in ("llama", "qwen2", "mistral", "gpt2", "phi3")]


def _run(matrix: list[tuple[str, dict]]) -> list:
    runs = []
    for family, cfg in matrix:
        start = time.perf_counter()
        run = run_layout(cfg, functools.partial(tiny_hf, family), corpus_windows(), STEPS,
                         keep_state=dist.get_rank() == 0, model_parameters=hf_param_groups)
        run.extra["seconds"] = time.perf_counter() - start
        runs.append(run)
    return runs


def _check(per_rank: list[list], matrix: list[tuple[str, dict]]) -> list[str]:
    refs, lines = {}, []
    for i, (family, cfg) in enumerate(matrix):
        run = per_rank[0][i]
        if family not in refs:
            refs[family] = reference_run(functools.partial(tiny_hf, family), reference_config(cfg, run),
                                         corpus_windows(), STEPS, loss_of=hf_loss, param_groups=hf_param_groups)
        summary = summarize(compare(run, refs[family]))
        assert summary["passed"], (family, run.case, summary)
        assert all(other[i].losses == run.losses for other in per_rank[1:]), (family, run.case)
        lines.append(f"{family} {run.case}: loss {summary['loss_err']:.1e} param {summary['param_err']:.1e} "
                     f"({run.extra['seconds']:.1f}s)")
    return lines


def test_every_layout_4_ranks(world4):
    lines = _check(world4.run(_run, MATRIX_4), MATRIX_4)
    print("\n".join(lines))
    assert len(lines) == len(MATRIX_4)


def test_dp2_pp2_tp2_8_ranks(world8):
    lines = _check(world8.run(_run, MATRIX_8), MATRIX_8)
    print("\n".join(lines))


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2", "phi3"])
def test_the_layered_view_computes_the_models_own_logits(family):
    from paratrain.models import HFCausalLM

    model = tiny_hf(family)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=ids).logits
    view = HFCausalLM(model)
    assert torch.equal(view(ids), expected)
    assert [n for n, _ in view.named_parameters()] == [n for n, _ in model.named_parameters()]
    out = view(input_ids=ids, labels=ids)  # transformers' form: labels shifted inside
    assert torch.allclose(out.loss, model(input_ids=ids, labels=ids).loss, rtol=1e-6)


def test_the_plan_comes_from_the_models_config():
    from paratrain.model_spec import spec_for
    from paratrain.models import HFCausalLM

    view = HFCausalLM(tiny_hf("qwen2"))
    plan = spec_for(view).tp_plan(view)
    assert plan["model.layers.*.self_attn.k_proj"] == "colwise"  # from Qwen2's base_model_tp_plan
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_vocab" and plan["loss_fn"] == "vocab_loss"
    assert plan["model.layers.*.post_attention_layernorm"] == "sequence"


@pytest.mark.parametrize("family, plan_entry", [("gpt2", "transformer.h.*.attn.c_attn': 'colwise:32,32,32"),
                                                ("phi3", "model.layers.*.self_attn.qkv_proj': 'colwise:32,16,16")])
def test_packed_projections_are_split_part_by_part(family, plan_entry):
    from paratrain.model_spec import spec_for
    from paratrain.models import HFCausalLM

    view = HFCausalLM(tiny_hf(family))
    assert plan_entry in str(spec_for(view).tp_plan(view))  # q, k and v (GQA: smaller k, v) each split on its own


def test_a_layer_no_rule_knows_is_refused_by_name_with_the_entry_to_write():
    from torch import nn

    from paratrain.model_spec import ModelSpecError, spec_for
    from paratrain.models import HFCausalLM

    model = tiny_hf("gpt2")
    for block in model.transformer.h:
        block.mlp.gate = nn.Linear(32, 32)  # a name no rule knows, in a model without an HF plan
    view = HFCausalLM(model)
    with pytest.raises(ModelSpecError, match=r"'transformer\.h\.\*\.mlp\.gate' \(Linear\)") as err:
        spec_for(view).tp_plan(view)
    assert '"transformer.h.*.mlp.gate": "colwise" | "rowwise" | "replicate"' in str(err.value)


# A DeepSpeed config as Hugging Face's DeepSpeed docs show it for ZeRO-3 and bf16 (numbers written in).
HF_DOCS_ZERO3 = {
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 2}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": 1024, "stage3_prefetch_bucket_size": 922,
                          "stage3_param_persistence_threshold": 320, "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 2000,
    "train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": False,
}


def _deepspeed_script() -> list[float]:
    """What a DeepSpeed user's script does with a transformers model, unchanged but for the import."""
    import paratrain as deepspeed

    model = tiny_hf("llama")
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=HF_DOCS_ZERO3)
    batch = torch.stack([corpus_windows()[i][0] for i in range(2 * dist.get_rank(), 2 * dist.get_rank() + 2)])
    losses = []
    for _ in range(6):
        outputs = engine(input_ids=batch, labels=batch)
        engine.backward(outputs.loss)
        engine.step()
        losses.append(float(outputs.loss.detach()))
    return losses


def test_a_deepspeed_script_with_a_transformers_model_runs_unchanged(world2):
    per_rank = world2.run(_deepspeed_script)
    for losses in per_rank:
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.5, losses


def test_huggingface_auto_values_are_refused_with_the_number_to_write():
    from paratrain.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config({**HF_DOCS_ZERO3, "train_micro_batch_size_per_gpu": "auto",
                     "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                     "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    message = str(err.value)
    assert "'train_micro_batch_size_per_gpu' = \"auto\": write the per-device batch size" in message
    assert "'optimizer.params.lr' = \"auto\"" in message and "hidden_size * hidden_size" in message


def _train_model_directory(directory: str, run_dir: str) -> dict:
    from paratrain.trainer import train

    return train({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
                  "tensor_parallel": {"size": 2, "sequence_parallel": True},
                  "trainer": {"model": directory, "steps": 3, "eval_every": 3, "eval_batches": 1, "run_dir": run_dir,
                              "progress_bar": False, "model_overrides": {"seq_len": 32}}})


def test_paratrain_train_takes_a_model_directory(world2, tmp_path):
    """The example's path: `trainer.model` = a save_pretrained directory, tp2 + SP, the corpus as bytes."""
    model = tiny_hf("qwen2")
    model.save_pretrained(tmp_path / "model")
    summaries = world2.run(_train_model_directory, str(tmp_path / "model"), str(tmp_path / "run"))
    summary = summaries[0]
    assert summary["params"] == sum(p.numel() for p in model.parameters()) and summary["layout"] == "tp2"
    assert summary["last_loss"] < summary["first_loss"] and summary["val_loss"] is not None
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_model_directory_takes_only_seq_len_as_override(tmp_path):
    """...within its max_position_embeddings (64), as data.seq_len; a path that is no model directory is named so."""
    from paratrain.config import ConfigError, load_config
    from paratrain.config.outputs import TrainerConfig
    from paratrain.trainer.inputs import corpus_ids, job_rows, model_directory, pretrained_model

    tiny_hf("llama").save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"trainer.model_overrides \['n_layer'\]"):
        pretrained_model(TrainerConfig(model=str(tmp_path), model_overrides={"n_layer": 2}))
    with pytest.raises(ConfigError, match="trainer.model_overrides.seq_len = 128 is longer than the model's "
                                          "max_position_embeddings 64 .*; lower it to at most 64"):
        pretrained_model(TrainerConfig(model=str(tmp_path), model_overrides={"seq_len": 128}))
    assert pretrained_model(TrainerConfig(model=str(tmp_path)))[4] == 64
    with pytest.raises(ConfigError, match="data.seq_len = 96 is longer than the model's max_position_embeddings 64"):
        job_rows(load_config({"data": {"train": "x.jsonl", "seq_len": 96}}), tmp_path, 128, 256, 64)
    assert model_directory(TrainerConfig(model=str(tmp_path))) == tmp_path
    assert model_directory(TrainerConfig(model="llama-tiny")) is None
    with pytest.raises(ConfigError, match=f"trainer.model = '{tmp_path}/no_model': the directory does not exist"):
        model_directory(TrainerConfig(model=str(tmp_path / "no_model")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is a directory without config.json"):
        model_directory(TrainerConfig(model=str(tmp_path / "empty")))
    small = tiny_hf("llama", vocab_size=64)
    small.save_pretrained(tmp_path / "small")
    with pytest.raises(ConfigError, match="vocab_size is 64"):
        corpus_ids("bytes beyond 64: ~", tmp_path / "small", 64)
