#!/usr/bin/env bash
# The checks that need a GPU, in one short run (CI has no GPU): the CUDA tests, `qkv demo` on the GPU,
# the attention benchmark on the GPU, then the whole test suite with CUDA visible (tests that pick
# "auto" devices then train on the GPU). Each part is time-boxed so the run always returns.
#
#     bash benchmarks/cuda_checks.sh OUT_DIR        # on a machine with CUDA and qkv installed
#
# Writes OUT_DIR/{env.txt,cuda_tests.log,demo.log,suite.log,attention.json,attention.png}. SUITE_SECONDS,
# SUITE_WORKERS and BENCH_SECONDS (0: no benchmark) size the parts.
set -uo pipefail
out=${1:?usage: bash benchmarks/cuda_checks.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  lscpu | grep -E "Model name|^CPU\(s\)"; } 2>&1 | tee "$out/env.txt"

echo "== CUDA tests"
timeout 150 $py -m pytest tests/test_cuda.py -q -p no:cacheprovider 2>&1 | tee "$out/cuda_tests.log" | tail -25

echo "== qkv demo on the GPU"
timeout 90 $py -m qkv demo --device cuda --out /tmp/qkv-demo-cuda --no-progress 2>&1 | tee "$out/demo.log" | tail -15

echo "== the whole suite, CUDA visible"
# -v writes each test's outcome as it ends, so a run cut by its time box still names its failures
timeout "${SUITE_SECONDS:-240}" $py -m pytest -v -rfE -n "${SUITE_WORKERS:-12}" -p no:cacheprovider > "$out/suite.log" 2>&1
grep -E "^(\[gw[0-9]+\] .*(FAILED|ERROR)|FAILED|ERROR)" "$out/suite.log" | sort -u | head -40
tail -3 "$out/suite.log"

if [ "${BENCH_SECONDS:-100}" -gt 0 ]; then  # BENCH_SECONDS=0 leaves the attention benchmark out
  echo "== attention benchmark on the GPU"
  timeout "${BENCH_SECONDS:-100}" $py -m qkv bench attention --device cuda --seq-lens 512,2048,8192 --out "$out/bench" \
      2>&1 | tail -30
  cp "$out"/bench/attention.json "$out"/bench/attention.png "$out"/ 2>/dev/null
  rm -rf "$out/bench"
fi
