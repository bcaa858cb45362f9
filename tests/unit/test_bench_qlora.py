"""The QLoRA benchmark's documented numbers are its committed JSON."""

from __future__ import annotations


def test_the_documented_qlora_numbers_are_the_committed_json():
    """docs/benchmarks.md carries the table `benchmarks.qlora` builds from its JSON, and the prose states its median
    ratios and the model-state bytes against FSDP2 + torchao (bitsandbytes' double quantization; torchao's own NF4,
    the like-for-like pair, at most 1.00 ×)."""
    import json
    import statistics
    from pathlib import Path

    from benchmarks.qlora import RESULTS, table

    out = json.loads(RESULTS.read_text())
    page = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    rows = [line for line in table(out).splitlines() if line.startswith("|")]
    assert rows and all(row in page for row in rows), rows
    prose = " ".join(page.split())
    last = out["rounds"][-1]
    double, peer = last["qlora_double"]["state_bytes_per_rank"][0], last["fsdp2_torchao"]["state_bytes_per_rank"][0]
    ratio = statistics.median(r["state_vs_fsdp2_double"] for r in out["rounds"])
    assert f"**{ratio:.3f} ×** FSDP2 + torchao's in every round ({double:,} vs {peer:,} bytes)" in prose
    step = statistics.median(r["step_vs_fsdp2"] for r in out["rounds"])
    assert f"paratrain's QLoRA is {step:.2f} × FSDP2 + torchao's" in prose
    # like for like: paratrain over torchao's own NF4
    torchao = last["qlora_torchao"]["state_bytes_per_rank"][0]
    ratio = statistics.median(r["state_vs_fsdp2_torchao"] for r in out["rounds"])
    assert ratio <= 1.0
    assert f"**{ratio:.5f} ×** FSDP2 + torchao's in every round ({torchao:,} vs {peer:,} bytes)" in prose
    step = statistics.median(r["step_vs_fsdp2_torchao"] for r in out["rounds"])
    assert f"paratrain over torchao's NF4 is {step:.2f} × FSDP2 + torchao's" in prose
