#!/usr/bin/env bash
# The GPU check, for a GPU machine with no network (its python3 has a CUDA torch, transformers,
# diffusers and peft). From the repository root:
#
#     bash tests/gpu/run.sh                 # results under $OUT (default out/gpu)
#     DEADLINE=300 bash tests/gpu/run.sh    # stop starting stages after 300 s
#     STAGES="pytest-gpu profile" bash tests/gpu/run.sh   # only these (build always runs)
#     DRY_RUN=1 PYTHON=.venv/bin/python bash tests/gpu/run.sh   # every stage on a CPU, tiny shapes
#
# DRY_RUN builds into a scratch directory (the tree's own build stays as it is; the later stages
# use it) with limits for a small CPU machine (DEADLINE 1500 s, the build 900 s).
#
# Stages, most important first; each is time-boxed (its limit, and never past DEADLINE,
# default 520 s), a failing stage does not stop the later ones, and the exit status says
# whether any failed or was not run:
#   build       attnstash/_C against that torch (CMake only: no pip, no GoogleTest)
#   info        versions, and the SDPA backend torch picks at the Qwen3-30B-A3B attention shape
#   pytest-gpu  every GPU test: each kept backend with and without masks, fully-masked rows,
#               opcheck, Hugging Face steps under both checkpointing modes (one backward, and
#               retain_graph then another), CUDA autocast
#               (bf16, fp16), the budget, the planner's prediction against the kept bytes, the
#               installer under inductor (the whole model; blocks inside eager checkpoints), the
#               user's offloading (transformers' offload=True; pinned save_on_cpu around a plain
#               model: the recompute handed a copy), both checkpointing modes
#   profile     one decoder layer at the Qwen3-30B-A3B attention shape (bf16, batch 4, 32 query /
#               4 KV heads of 128, sequence 4096, causal) under torch.profiler: reentrant and
#               non-reentrant, without and with the stash, and SAC (profile.md)
#   layer       the same layer timed, interleaved rounds (layer.json)
#   seq-sweep   sequence lengths 1k to 32k at that attention shape, batch 4 (seq_sweep.png)
#   offload     the same at 16k and 32k under the user's offloading (save_on_cpu, pinned) around
#               every configuration (what the stash keeps goes through it), and the stash with its
#               own offload (offload=True): peak device memory, step times, recompute waits
#               (offload_waits), the stash against SAC (offload/seq_sweep.json, offload_seq_sweep.png)
#   bench       a 4-layer model at that shape, one step per configuration (bench.png)
#   compile     the 4-layer model under torch.compile (inductor): compiled checkpointing without and
#               with the stash, compiled SAC, eager with the stash; graphs, attention forwards per
#               step, step time (compile.json)
#   dit         a Flux transformer (24 heads of 128, 512 text tokens) at 4096 and 16384 image
#               tokens: no checkpointing, checkpointing, the stash, SAC (dit.json)
#   pytest      the rest of the suite on this machine
#
# Under $OUT: summary.txt (one line per stage), results.tar.gz (every log, JSON and PNG,
# refreshed after each stage), and the files read first: profile.md, layer.json, seq_sweep.png,
# bench.png, compile.json, dit.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out/gpu}
mkdir -p "$OUT"
WORK=$(mktemp -d)
PY=${PYTHON:-python3}
case $PY in /*) ;; */*) PY=$PWD/$PY ;; *) PY=$(command -v "$PY") ;; esac  # CMake needs an absolute path
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ "${DRY_RUN:-0}" = 1 ]; then
  DEADLINE=${DEADLINE:-1500} BUILD_LIMIT=900 BUILD_DIR=$WORK/build BUILD_ARGS=(-DATTNSTASH_OUTPUT_DIR="$WORK/build")
  DEVICE=cpu PRESET=tiny SEQS=64,128 SWEEP_SECONDS=5 PYTEST_REST=(--co) QUICK=(--repeats 2 --warmup 0)
  OFFLOAD_SEQS=128
  DIT=(--preset dit --tokens 64,128 --heads 2 --head-dim 16 --layers 1 --single-layers 1 --text-tokens 16)
else
  DEADLINE=${DEADLINE:-520} BUILD_LIMIT=240 BUILD_DIR=build/gpu BUILD_ARGS=()
  DEVICE=cuda PRESET=qwen3-30b-a3b SEQS=1024,4096,16384,32768 SWEEP_SECONDS=60 PYTEST_REST=() QUICK=()
  OFFLOAD_SEQS=16384,32768
  DIT=(--preset flux --tokens 4096,16384)
fi
echo "stage | exit | seconds" > "$OUT/summary.txt"
failed=()

collect() {  # the results so far into $OUT (the archive, and the files read first)
  tar -czf "$OUT/results.tar.gz.tmp" -C "$WORK" . && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
  for f in profile.md layer.json seq_sweep.png bench.png compile.json dit.json; do
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/$f"
  done
  [ -f "$WORK/offload/seq_sweep.png" ] && cp "$WORK/offload/seq_sweep.png" "$OUT/offload_seq_sweep.png"
  return 0
}

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  if [ -n "${STAGES:-}" ] && [ "$name" != build ] && [[ " $STAGES " != *" $name "* ]]; then
    return
  fi
  local left=$((DEADLINE - SECONDS))
  if ((left < 20)); then
    echo "=== $name: not run (${left}s left of DEADLINE=${DEADLINE}s)"
    echo "$name | not run | 0" >> "$OUT/summary.txt"
    failed+=("$name(not run)")
    return
  fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$WORK/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0))s"
  echo "$name | $rc | $((SECONDS - t0))" >> "$OUT/summary.txt"
  ((rc == 0)) || failed+=("$name")
  collect
}

# Build with the system compiler where there is one: a compiler that links parts of its
# libstdc++ statically into shared objects makes the extension crash in iostreams.
compilers=()
if [ -x /usr/bin/gcc ] && [ -x /usr/bin/g++ ]; then
  compilers=(-DCMAKE_C_COMPILER=/usr/bin/gcc -DCMAKE_CXX_COMPILER=/usr/bin/g++)
fi
generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
stage build "$BUILD_LIMIT" bash -c "cmake -S . -B $BUILD_DIR ${generator[*]} -DPython_EXECUTABLE=$PY \
  -DCMAKE_BUILD_TYPE=Release ${compilers[*]} ${BUILD_ARGS[*]} && cmake --build $BUILD_DIR -j $(nproc)"

stage info 90 bash -c "$PY -m attnstash.info && $PY -c '
import torch
from torch.nn.attention import SDPBackend
dev = \"$DEVICE\"
if dev == \"cuda\":
    print(\"device:\", torch.cuda.get_device_name(), \"cuDNN\", torch.backends.cudnn.version(), \"CUDA\", torch.version.cuda)
    q = torch.randn(4, 32, 4096, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(4, 4, 4096, 128, device=dev, dtype=torch.bfloat16)
    for grad in (False, True):
        qq, kk = q.requires_grad_(grad), k.requires_grad_(grad)
        choice = torch._fused_sdp_choice(qq, kk, kk, None, 0.0, True, enable_gqa=True)
        print(f\"Qwen3-30B-A3B attention (bf16, B4 H32/4 S4096 D128, causal, GQA, requires_grad={grad}):\",
              SDPBackend(choice).name)
'"

# Every test that needs a GPU: test_gpu_ops.py (the ops), test_plan_cuda.py (the planner's
# CUDA rules against torch's own choice), test_gpu_compile.py (the installer under inductor) and
# test_gpu_offload.py (the user's offloading, the recompute handed a copy).
stage pytest-gpu 300 $PY -m pytest tests/python/test_gpu_ops.py tests/python/test_plan_cuda.py tests/python/test_gpu_compile.py \
  tests/python/test_gpu_offload.py \
  -v -rs -p no:cacheprovider --junitxml="$WORK/pytest-gpu.xml"

BENCH=("$PY" -m benchmarks --preset "$PRESET" --device "$DEVICE" --out "$WORK")
stage profile 150 "${BENCH[@]}" --mode profile "${QUICK[@]}"
stage layer 120 "${BENCH[@]}" --mode layer "${QUICK[@]}"
stage seq-sweep 240 "${BENCH[@]}" --mode seq-sweep --seqs "$SEQS" --sweep-seconds "$SWEEP_SECONDS"
stage offload 150 "$PY" -m benchmarks --mode seq-sweep --offload --preset "$PRESET" --device "$DEVICE" \
  --out "$WORK/offload" --seqs "$OFFLOAD_SEQS" --sweep-seconds 30
stage bench 200 "${BENCH[@]}" "${QUICK[@]}"
stage compile 240 "${BENCH[@]}" --mode compile "${QUICK[@]}"
stage dit 200 "$PY" -m benchmarks --mode dit --device "$DEVICE" --out "$WORK" "${DIT[@]}" "${QUICK[@]}"
stage pytest 300 $PY -m pytest tests/python -q -rs -p no:cacheprovider --ignore=tests/python/test_gpu_ops.py --ignore=tests/python/test_gpu_compile.py \
  --ignore=tests/python/test_gpu_offload.py \
  --junitxml="$WORK/pytest.xml" "${PYTEST_REST[@]}"

echo "=== failed stages: ${failed[*]:-none}" | tee -a "$OUT/summary.txt"
collect
rm -rf "$WORK"
((${#failed[@]} == 0))
