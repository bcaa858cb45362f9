#!/usr/bin/env bash
# The GPU checks of issue 9 as one prepared run (about 6 minutes on one H200); results under $OUT.
#   OUT=gpu_out bash benchmarks/gpu_check.sh
# Where the GPU machine lacks a runtime dependency (pydantic there), wheels in .whl/ are installed first.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, pydantic; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'pydantic', pydantic.__version__)"
  nproc; } 2>&1 | tee "$OUT/machine.txt"
# 1. Throughput and MFU through the engine (bf16, fused AdamW, clipping, compiled blocks).
timeout 150 python3 -m benchmarks.gpu_mfu --preset gpt-1.3b --micro-batch 8 --steps 15 --out "$OUT/mfu_1.3b.json" 2>&1 | tail -22
timeout 170 python3 -m benchmarks.gpu_mfu --preset gpt-2.7b --micro-batch 8 --steps 10 --out "$OUT/mfu_2.7b.json" 2>&1 | tail -22
# 1b. Engine overhead against the plain PyTorch AMP loop (fp32 model, autocast bf16 forward), same model.
timeout 150 python3 -m benchmarks.gpu_mfu --preset gpt-1.3b --precision autocast --plain --steps 10 --out "$OUT/plain_autocast.json" 2>&1 | tail -22
timeout 150 python3 -m benchmarks.gpu_mfu --preset gpt-1.3b --precision autocast --steps 10 --out "$OUT/engine_autocast.json" 2>&1 | tail -22
# 2. The GPU path and GPU checkpoints (tests skipped on CPU machines).
timeout 200 python3 -m pytest -o addopts="" -q -rfE -p no:cacheprovider tests/test_gpu_path.py tests/test_checkpoint_gpu.py \
  2>&1 | tee "$OUT/gpu_tests.txt" | tail -40
