"""The LoRA fine-tuning job: `examples/sft/job_lora.json` end to end, and an adapter job killed and resumed.

The example's job (a transformers Llama directory as the frozen base, loaded into dp2·tp2 SP ZeRO-3 with its
adapters put in by the `peft` section, packed chats streamed by tokenizer workers) trains a few steps and writes
its adapter and (trainer.save_merged) the merged model; peft loads that adapter onto the same base directory with
every key in place, and alone (`AutoPeftModelForCausalLM`: it names its base), the adapted model is not the base,
and the merged model's logits equal it within 1e-5. An adapter job on the built-in Llama (ZeRO-3, checkpoints
without the frozen base) killed after step 5 resumes from its step-3 checkpoint bit for bit, on the same samples;
resumed in dp2·tp2 instead, it trains the same samples with losses within 1e-5.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from tests.cases import import_or_skip
from tests.distributed.test_data_job import (
    SAVED_AT,
    STEPS,
    _as_killed_after_step,
    _rows,
    _train,
    job_config,
    write_records,
)

peft = import_or_skip("peft")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sft"
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}


def _example_job(root: str) -> dict:
    from paratrain.trainer import train

    config = json.loads((EXAMPLE / "job_lora.json").read_text())
    config["data"] |= {"train": f"{root}/train.jsonl", "validation": f"{root}/validation.jsonl"}
    config["checkpoint"] |= {"dir": f"{root}/ck", "save_every": 2}
    config["trainer"] |= {"model": f"{root}/model", "steps": 3, "eval_every": 3, "run_dir": f"{root}/run",
                          "save_pretrained": f"{root}/lora", "save_merged": True, "progress_bar": False}
    return train(config)


def test_the_example_lora_job_writes_an_adapter_peft_loads(world4, tmp_path):
    """... with trainer.save_merged: the adapter in lora/adapter (peft's AutoPeftModel finds its base from it) and the
    merged model in lora/merged, whose logits are the base's with the adapter within 1e-5."""
    import importlib.util

    import transformers

    loader = importlib.util.spec_from_file_location("make_data", EXAMPLE / "make_data.py")
    make_data = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(make_data)
    make_data.main(["--out", str(tmp_path)])
    summary = world4.run(_example_job, str(tmp_path))[0]
    assert 0 < summary["trainable_params"] < summary["frozen_params"] / 10
    assert summary["params"] == summary["trainable_params"] + summary["frozen_params"]  # the adapters counted
    assert summary["layout"] == "dp2 x tp2 ZeRO-3"
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(input_ids=ids).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "lora" / "adapter")
    assert not [w for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    with torch.no_grad():
        after = adapted(input_ids=ids).logits
        alone = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "lora" / "adapter")(input_ids=ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lora" / "merged")(input_ids=ids).logits
    assert not torch.allclose(after, before, atol=1e-4)  # the adapter trained: B moved off zero
    assert torch.equal(alone, after)  # the adapter names its base: the same model
    assert (merged - after).abs().max() <= 1e-5, (merged - after).abs().max()
    from paratrain.report import build_report

    build_report(tmp_path / "run")  # what `paratrain report` writes: the counts are in the summary
    assert f"{summary['trainable_params']:,} trainable" in (tmp_path / "run" / "summary.md").read_text()


def _lora_job(data: str, run: Path, micro: int, **axes) -> dict:
    config = job_config(data, str(run), str(run / "ck"), micro=micro, accumulation=2, **axes)
    config["zero_optimization"] = {"stage": 3}
    config["checkpoint"]["exclude_frozen_parameters"] = True
    config["peft"] = LORA
    return config


def test_an_adapter_job_killed_resumes_bit_for_bit_and_on_another_layout(world2, world4, tmp_path):
    data = tmp_path / "train.jsonl"
    write_records(data)
    base = tmp_path / "dp2"
    world2.run(_train, _lora_job(str(data), base, micro=2))
    want = _rows(base)
    killed = tmp_path / "killed"
    shutil.copytree(base, killed)
    _as_killed_after_step(killed / "ck", 5)  # the last save at step 3: steps 4-6 again
    again = world2.run(_train, _lora_job(str(data), killed, micro=2))[0]
    assert again["resumed_at"] == SAVED_AT and len(want) == STEPS
    got = _rows(killed)
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert [r["samples"] for r in got] == [r["samples"] for r in want]
    moved = tmp_path / "dp2tp2"
    shutil.copytree(base, moved)
    _as_killed_after_step(moved / "ck", SAVED_AT)
    world4.run(_train, _lora_job(str(data), moved, micro=2, tp=2))
    got = _rows(moved)
    assert [r["samples"] for r in got] == [r["samples"] for r in want]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
