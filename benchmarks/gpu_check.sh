#!/usr/bin/env bash
# The GPU checks as one prepared run.
#   bash benchmarks/gpu_check.sh           # one GPU (about 6 minutes on an H200): MFU runs + the GPU tests
#   bash benchmarks/gpu_check.sh --multi   # N >= 2 GPUs: the hybrid parity matrix over NCCL, one rank per GPU
# Every run's raw JSON goes to benchmarks/results/gpu/ (commit those files); logs and the machine description
# go to $OUT (default: the same folder). On a lent machine whose $OUT is all that comes back, the JSON files
# are copied there too. Where the machine lacks a runtime dependency (pydantic), wheels in .whl/ are installed.
set -u
export PYTHONUNBUFFERED=1
RESULTS=benchmarks/results/gpu
OUT=${OUT:-$RESULTS}
mkdir -p "$RESULTS" "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, pydantic; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'pydantic', pydantic.__version__)"
  nproc; } 2>&1 | tee "$OUT/machine.txt"

if [ "${1:-}" = "--multi" ]; then
  # Multi-rank NCCL: until this has run on a multi-GPU machine, NCCL with more than one rank is unverified
  # (the one-GPU tests run a world of one, where every all-reduce is a no-op). 8, 4 and 2 ranks, as many fit.
  ngpu=$(nvidia-smi -L | wc -l)
  status=0
  for n in 8 4 2; do
    [ "$ngpu" -ge "$n" ] || continue
    timeout 600 python3 -m torch.distributed.run --standalone --nproc-per-node "$n" -m benchmarks.gpu_parity \
      --out "$RESULTS/parity_${n}gpu.json" 2>&1 | tee "$OUT/parity_${n}gpu.txt" | grep -v Warning | tail -24
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  [ "$ngpu" -ge 2 ] || { echo "--multi needs at least 2 GPUs, this machine has $ngpu"; status=1; }
  [ "$OUT" = "$RESULTS" ] || cp "$RESULTS"/parity_*gpu.json "$OUT"/ 2>/dev/null
  exit $status
fi

# 1. Throughput and MFU through the engine (bf16, fused AdamW, clipping, compiled blocks).
timeout 150 python3 -m benchmarks.gpu_mfu --preset gpt-1.3b --micro-batch 8 --steps 15 --out "$RESULTS/mfu_gpt-1.3b_bf16.json" 2>&1 | tail -45
timeout 170 python3 -m benchmarks.gpu_mfu --preset gpt-2.7b --micro-batch 8 --steps 10 --out "$RESULTS/mfu_gpt-2.7b_bf16.json" 2>&1 | tail -45
# 1b. Engine overhead against the plain PyTorch AMP loop (fp32 model, autocast bf16 forward), same model.
timeout 150 python3 -m benchmarks.gpu_mfu --preset gpt-1.3b --precision autocast --plain --steps 10 --out "$RESULTS/mfu_gpt-1.3b_autocast_plain.json" 2>&1 | tail -45
timeout 150 python3 -m benchmarks.gpu_mfu --preset gpt-1.3b --precision autocast --steps 10 --out "$RESULTS/mfu_gpt-1.3b_autocast.json" 2>&1 | tail -45
# 2. The GPU path and GPU checkpoints (tests skipped on CPU machines).
timeout 200 python3 -m pytest -o addopts="" -q -rfEs -p no:cacheprovider tests/unit/test_gpu_path.py tests/distributed/test_checkpoint_gpu.py \
  2>&1 | tee "$OUT/gpu_tests.txt" | tail -40
[ "$OUT" = "$RESULTS" ] || cp "$RESULTS"/mfu_*.json "$OUT"/ 2>/dev/null
exit 0
