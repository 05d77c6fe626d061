#!/usr/bin/env bash
# Mutation testing for attnstash: does the pytest suite catch the bugs it is meant to?
#
#     bash tests/mutations/run.sh                      # every tests/mutations/*.patch
#     bash tests/mutations/run.sh 05-anchor-version-not-in-key 09-entry-not-released-after-take
#     PYTHON=/path/to/python KEEP=1 bash tests/mutations/run.sh
#
# NOT part of CI or `make test`: it builds the extension once and rebuilds it for every
# C/C++ mutation, and runs the suite once per mutation: about 3.6 minutes a patch on 2 cores
# shared with other builds, so about two hours for the 51 patches (the baseline build 6
# minutes, the unmutated suite 14, a mutation the suite misses runs it whole, 13 to 18; the
# caught ones 0.5 to 11 each).
#
# What it does, never touching the checkout it is run from:
#   1. copies the working tree (tracked + untracked-not-ignored files, as
#      `git ls-files -co --exclude-standard` lists them) to a temporary directory, makes
#      that copy a throw-away git repository, builds attnstash/_C there with CMake (one
#      build dir, so later rebuilds are incremental) and runs the suite unmutated: it
#      must pass (BASELINE=0 skips that run);
#   2. for each patch: `git apply` it, rebuild (only what changed: a Python-only patch
#      rebuilds nothing), run pytest with -x, record the first failing test (caught) or
#      "NOT CAUGHT", then `git apply -R` it (the reverted files are rebuilt by the next
#      mutation's build);
#   3. prints a table (mutation, caught, the test that caught it) and exits non-zero if
#      any mutation survived, did not apply or did not build.
#
# The suite run for each mutation, in this order (-x stops at the first failure, so the
# fast files that catch most mutations go first): tests/python/test_sdpa_ops*.py (the ops),
# test_budget*.py, test_any_model.py, test_edge_inputs.py, test_huggingface*.py,
# test_training_setups.py, test_trainer.py, then every other tests/python/test_*.py in name
# order (test_gpu_ops.py's tests skip without CUDA), test_tools.py (trl and accelerate launch,
# a subprocess each) last. Nothing is excluded. The GoogleTest suites (tests/cpp) are not run.
# Override with PYTEST_FILES="..." (exact paths, in the order to run).
#
# Each patch is a unified diff relative to the repository root (made with `git diff`),
# preceded by '#' comment lines saying which bug it reintroduces (git apply ignores text
# before the first diff header). A patch that no longer applies after the sources changed
# is reported as such: refresh it (keep it to a few lines).
#
# Environment:
#   PYTHON        the Python with torch, transformers and pytest (default: the checkout's
#                 .venv/bin/python)
#   JOBS          build parallelism (default: nproc)
#   TIMEOUT       seconds allowed for one pytest run (default 1200; a hang counts as caught)
#   BASELINE=0    skip the unmutated pytest run
#   KEEP=1        keep the temporary directory (tree, build and logs) and print its path
#   WORK=dir      use this (new or empty) directory instead of a mktemp one
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(git -C "$HERE" rev-parse --show-toplevel) || { echo "run.sh: not inside a git checkout" >&2; exit 2; }
PY=${PYTHON:-$REPO/.venv/bin/python}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
TIMEOUT=${TIMEOUT:-1200}
BASELINE=${BASELINE:-1}
KEEP=${KEEP:-0}

[ -x "$PY" ] || { echo "run.sh: no Python at $PY (set PYTHON=...)" >&2; exit 2; }
"$PY" -c "import torch, pytest" 2>/dev/null || { echo "run.sh: $PY lacks torch or pytest" >&2; exit 2; }

# The patches: every tests/mutations/*.patch, or the names given (with or without .patch).
patches=()
if [ $# -gt 0 ]; then
  for name in "$@"; do
    p=$HERE/${name%.patch}.patch
    [ -f "$p" ] || { echo "run.sh: no patch $p" >&2; exit 2; }
    patches+=("$p")
  done
else
  for p in "$HERE"/*.patch; do [ -f "$p" ] && patches+=("$p"); done
fi
[ ${#patches[@]} -gt 0 ] || { echo "run.sh: no patches in $HERE" >&2; exit 2; }

if [ -n "${WORK:-}" ]; then
  mkdir -p "$WORK" && [ -z "$(ls -A "$WORK")" ] || { echo "run.sh: WORK=$WORK must be new or empty" >&2; exit 2; }
else
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/attnstash-mutations.XXXXXX")
fi
TREE=$WORK/tree
BUILD=$TREE/build
LOGS=$WORK/logs
mkdir -p "$TREE" "$LOGS"
cleanup() { if [ "$KEEP" = 1 ]; then echo "kept: $WORK"; else rm -rf "$WORK"; fi; }
trap cleanup EXIT
trap 'echo "interrupted" >&2; exit 130' INT TERM

t_start=$SECONDS
elapsed() { local s=$((SECONDS - ${1:-$t_start})); printf '%dm%02ds' $((s / 60)) $((s % 60)); }
log() { echo "[$(elapsed)] $*"; }

# 1. The copy: a snapshot of the working tree as it is now (others may be editing it).
log "copying $REPO (HEAD $(git -C "$REPO" rev-parse --short HEAD), with uncommitted changes) to $TREE"
git -C "$REPO" ls-files -co --exclude-standard -z |
  while IFS= read -r -d '' f; do [ -f "$REPO/$f" ] && printf '%s\0' "$f"; done |
  tar -C "$REPO" --null -T - -cf - | tar -C "$TREE" -xf - || { echo "run.sh: copy failed" >&2; exit 2; }
git -C "$TREE" init -q && git -C "$TREE" add -A &&
  git -C "$TREE" -c user.name=mutations -c user.email=mutations@localhost commit -qm snapshot ||
  { echo "run.sh: cannot make the copy a git repository" >&2; exit 2; }

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
build() {  # build LOGFILE: configure once, then incremental builds
  {
    if [ ! -f "$BUILD/CMakeCache.txt" ]; then
      cmake -S "$TREE" -B "$BUILD" "${GEN[@]}" -DPython_EXECUTABLE="$PY" -DATTNSTASH_OUTPUT_DIR="$TREE/attnstash" \
        -DCMAKE_BUILD_TYPE=Release || return 1
    fi
    cmake --build "$BUILD" -j "$JOBS"
  } >"$1" 2>&1
}

files=()
if [ -n "${PYTEST_FILES:-}" ]; then
  read -r -a files <<<"$PYTEST_FILES"
else
  # Globs, so that a file split or added later keeps its place: the fast files that catch
  # most mutations first, then every other file in name order, the slowest (`last`) at the end.
  first=('test_sdpa_ops_bitwise.py' 'test_sdpa_ops_phases.py' 'test_sdpa_ops_refusals.py' 'test_sdpa_ops*.py'
         'test_budget*.py' 'test_any_model.py' 'test_edge_inputs.py'
         'test_huggingface_training.py' 'test_huggingface_refusals.py' 'test_huggingface*.py'
         'test_training_setups.py' 'test_trainer.py')
  last=('test_tools.py')  # names: the command-line tools, a subprocess each (trl, accelerate launch)
  add() { case " ${files[*]} " in *" $1 "*) ;; *) [ -f "$TREE/$1" ] && files+=("$1") ;; esac; }
  for p in "${first[@]}"; do for f in "$TREE"/tests/python/$p; do add "tests/python/${f##*/}"; done; done
  for f in "$TREE"/tests/python/test_*.py; do
    case " ${last[*]} " in *" ${f##*/} "*) ;; *) add "tests/python/${f##*/}" ;; esac
  done
  for p in "${last[@]}"; do add "tests/python/$p"; done
fi
run_suite() {  # run_suite LOGFILE: pytest -x on the copy; returns pytest's exit status
  (cd "$TREE" && PYTHONPATH=$TREE PYTHONDONTWRITEBYTECODE=1 timeout "$TIMEOUT" \
    "$PY" -m pytest "${files[@]}" -x -q -p no:cacheprovider) >"$1" 2>&1
}
first_failure() {  # the id of the first FAILED/ERROR test in a pytest log
  sed -n -E 's/^(FAILED|ERROR) ([^ ]+).*/\2/p' "$1" | head -n 1
}

log "building the unmutated extension ($PY, $JOBS jobs)"
build "$LOGS/build-baseline.log" || { tail -n 30 "$LOGS/build-baseline.log"; echo "run.sh: the unmutated build failed" >&2; exit 2; }
(cd "$TREE" && PYTHONPATH=$TREE "$PY" -c "import attnstash, sys; sys.exit(not attnstash.__file__.startswith('$TREE/'))") ||
  { echo "run.sh: attnstash is not imported from the copy" >&2; exit 2; }
if [ "$BASELINE" = 1 ]; then
  log "running the unmutated suite: ${files[*]}"
  run_suite "$LOGS/pytest-baseline.log"
  rc=$?
  if [ $rc -ne 0 ]; then
    tail -n 30 "$LOGS/pytest-baseline.log"
    echo "run.sh: the unmutated suite fails (exit $rc), so mutations cannot be judged" >&2
    KEEP=1
    exit 2
  fi
  log "unmutated suite: $(tail -n 1 "$LOGS/pytest-baseline.log")"
fi

# 2. One mutation at a time.
names=() caught=() by=() times=()
bad=0
for patch in "${patches[@]}"; do
  name=$(basename "$patch" .patch)
  t0=$SECONDS
  result="" test=""
  log "== $name"
  if ! git -C "$TREE" apply --check "$patch" 2>"$LOGS/$name.apply.log"; then
    result="no" test="PATCH DOES NOT APPLY (refresh it): $(head -n 1 "$LOGS/$name.apply.log")"
  else
    git -C "$TREE" apply "$patch"
    if ! build "$LOGS/$name.build.log"; then
      result="no" test="BUILD FAILED (see $name.build.log)"
    else
      run_suite "$LOGS/$name.pytest.log"
      rc=$?
      test=$(first_failure "$LOGS/$name.pytest.log")
      case $rc in
        0) result="no" test="NOT CAUGHT" ;;
        1) result="yes" ;;
        124) result="yes" test="TIMEOUT after ${TIMEOUT}s (hang)${test:+; first failure $test}" ;;
        *) result="yes"
           [ -n "$test" ] || test="pytest exit $rc (crash?): $(grep -m 1 -E 'Fatal Python error|Error' "$LOGS/$name.pytest.log")" ;;
      esac
    fi
    git -C "$TREE" apply -R "$patch" || true
    if [ -n "$(git -C "$TREE" status --porcelain)" ]; then  # never let a mutation leak into the next
      git -C "$TREE" checkout -q -- . && git -C "$TREE" clean -qfd -e build
    fi
  fi
  [ "$result" = yes ] || bad=1
  names+=("$name") caught+=("$result") by+=("$test") times+=("$(elapsed "$t0")")
  log "   caught: $result  ${test}"
done

# 3. The table.
echo
w=8
for n in "${names[@]}"; do [ ${#n} -gt $w ] && w=${#n}; done
printf "%-${w}s  %-6s  %-7s  %s\n" mutation caught time "caught by (first failing test)"
printf "%-${w}s  %-6s  %-7s  %s\n" "$(printf '%*s' $w '' | tr ' ' -)" ------ ------- ------------------------------
for i in "${!names[@]}"; do
  printf "%-${w}s  %-6s  %-7s  %s\n" "${names[$i]}" "${caught[$i]}" "${times[$i]}" "${by[$i]}"
done
echo
survivors=0
for c in "${caught[@]}"; do [ "$c" = yes ] || survivors=$((survivors + 1)); done
echo "${#names[@]} mutations, $((${#names[@]} - survivors)) caught, $survivors not caught; total $(elapsed)"
[ "$KEEP" = 1 ] && echo "logs: $LOGS"
exit $bad
