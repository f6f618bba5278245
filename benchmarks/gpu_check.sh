#!/usr/bin/env bash
# The GPU check: one prepared run on a lent GPU machine (never in CI; CI has no GPU).
#   1. the core's tests on that machine: tests/test_cuda.py (batched greedy identity and the exact sampled
#      distribution on CUDA) and the core's CPU tests under that machine's own torch;
#   2. `rvqspec bench --batch` on the GPU (latency table per (B, N), frames/s of our batched AR and the policy);
#   3. `rvqspec bench` on the GPU (per-call latency, acceptance-controlled speed-up of the 0.6B architecture);
#   4. `rvqspec bench --quick --archs 0.6b,csm-1b` on the GPU: CSM-1B's depth decoder beside the 0.6B (csm/);
#   5. benchmarks/gpu_graph_baseline.py: our frames eager and from CUDA graphs (B = 1..64), torch.compile's
#      reduce-overhead, and faster-qwen3-tts's CUDA-graph predictor frame (graph-baseline.*), from its wheel in
#      .wheels/ (carry it: run(..., carry=[".wheels"])). tests/test_cuda.py holds the graph path's exactness tests.
# Its packages are the image's own (no install there): rvqspec runs from the checkout. Reports go to $OUT
# (the device tool's folder) or benchmarks/results/gpu: gpu-check.log, bench-batch.*, bench.*, cache/device.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 RVQSPEC_CACHE=$OUT/cache
PY=${PYTHON:-python3}
LOG=$OUT/gpu-check.log
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), 'cuda', torch.version.cuda)"
  echo "== tests"
  $PY -m pytest -q -p no:cacheprovider -n 8 tests/test_cuda.py tests/test_graphs.py tests/test_speculative.py tests/test_distribution.py \
      tests/test_properties.py tests/test_policy.py tests/test_model.py tests/test_tree.py tests/test_drafters.py \
      tests/test_csm.py
  echo "== rvqspec bench --batch (GPU)"
  $PY -m rvqspec.cli.main bench --batch 1,2,4,8,16 --device cuda --dtype bfloat16,float32 --threads 1 --out "$OUT"
  echo "== rvqspec bench (GPU)"
  $PY -m rvqspec.cli.main bench --archs 0.6b --device cuda --dtype bfloat16,float32 --threads 1 --out "$OUT"
  echo "== rvqspec bench --archs 0.6b,csm-1b (GPU)"
  $PY -m rvqspec.cli.main bench --archs 0.6b,csm-1b --quick --device cuda --dtype bfloat16 --threads 1 --no-device-file \
      --out "$OUT/csm"
  echo "== faster-qwen3-tts CUDA-graph baseline (GPU)"
  $PY benchmarks/gpu_graph_baseline.py --out "$OUT"
} 2>&1 | tee "$LOG"
