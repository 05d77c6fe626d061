#!/usr/bin/env bash
# The GPU check, written to run blind on the GPU machine (no network; python3 there
# has a CUDA torch). From the repository root:
#
#     bash tests/gpu/run.sh            # results under $OUT (the device tool) or out/gpu
#
# It builds attnstash against that torch (CMake only: no pip, no GoogleTest), prints
# the versions and the SDPA backend torch picks for the Qwen3-30B-A3B attention shape,
# runs the GPU tests (every kept backend with and without masks), then the rest of the
# pytest suite, then the benchmark in model and layer mode (JSON and PNG under $OUT).
# About 6 minutes on an H200 after the machine starts. Each stage is
# time-boxed and a failing stage does not stop the later ones; the exit status says
# whether any failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
failed=()
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0))s"
  ((rc == 0)) || failed+=("$name")
}

# The GPU image's default compiler (/opt/gcc) puts pieces of its libstdc++ into the
# shared object itself, and their iostreams crash inside torch's process (seen on the
# H200 machine): build with the system compiler when there is one.
compilers=()
if [ -x /usr/bin/gcc ] && [ -x /usr/bin/g++ ]; then
  compilers=(-DCMAKE_C_COMPILER=/usr/bin/gcc -DCMAKE_CXX_COMPILER=/usr/bin/g++)
fi
stage build 240 bash -c "cmake -S . -B build/gpu -G Ninja -DPython_EXECUTABLE=$(command -v $PY) \
  -DCMAKE_BUILD_TYPE=Release ${compilers[*]} >/dev/null && cmake --build build/gpu -j 16"
stage info 60 $PY -m attnstash.info
stage backend 60 $PY - <<'PY'
import torch
from torch.nn.attention import SDPBackend
q = torch.randn(4, 32, 4096, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(4, 4, 4096, 128, device="cuda", dtype=torch.bfloat16)
for grad in (False, True):
    qq, kk = q.requires_grad_(grad), k.requires_grad_(grad)
    choice = torch._fused_sdp_choice(qq, kk, kk, None, 0.0, True, enable_gqa=True)
    print(f"Qwen3-30B-A3B attention (bf16, B4 H32/4 S4096 D128, causal, GQA, requires_grad={grad}):",
          SDPBackend(choice).name)
PY
# The GPU tests first, on their own (every kept backend, with and without masks), so that
# they have run whatever happens later; then the rest of the suite on this machine.
stage pytest-gpu 180 $PY -m pytest tests/python/test_gpu_ops.py -v -s -rs -p no:cacheprovider \
  --junitxml="$OUT/pytest-gpu.xml"
stage pytest 300 $PY -m pytest tests/python -q -rs -p no:cacheprovider --ignore=tests/python/test_gpu_ops.py \
  --junitxml="$OUT/pytest.xml"
# The Qwen3-30B-A3B attention shape: a 4-layer model (step time, memory, efficiency,
# the SAC peer), then one decoder-layer recompute with and without the stash.
stage bench 240 $PY -m attnstash.bench --preset qwen3-30b-a3b --device cuda --out "$OUT"
stage bench-layer 120 $PY -m attnstash.bench --mode layer --preset qwen3-30b-a3b --device cuda --out "$OUT"

echo "=== failed stages: ${failed[*]:-none}"
((${#failed[@]} == 0))
