#!/usr/bin/env bash
# The CPU suite (ctest + pytest tests/python) on each minor torch release of the supported
# range, the newest patch of each, one release at a time. Not part of CI: about 10 minutes a
# release on two cores once its wheels are cached (fetching them the first time takes longer),
# and every release but the CPU 2.13.0 is a CUDA wheel of several GB.
#
#   bash tests/torch_matrix.sh                  every release in RELEASES below
#   bash tests/torch_matrix.sh 2.11.0 2.15.0    only these
#   make torch-matrix [TORCH_MATRIX="2.11.0 2.15.0"]
#
# For each release: its torch and tests/requirements.txt's pins are fetched once into a wheel
# cache outside the repository ($TORCH_MATRIX_CACHE) and installed from there alone (pip
# --no-index) into a new venv; attnstash is built as `make build` builds it, in a copy of the
# working tree (the tree's own attnstash/_C stays built for its own torch); ctest and pytest
# run (the GPU tests skip); the venv, the copy and the build are deleted. One line per
# release goes to $OUT/results.md (a rerun replaces it), the logs to $OUT/<release>/.
#
# Environment: TORCH_MATRIX_CACHE (default ~/.cache/attnstash-torch-matrix), OUT (default
# out/torch-matrix), JOBS (build and ctest jobs, default 2), BOOTSTRAP_PYTHON (default
# python3), KEEP=1 keeps each release's venv, copy and build (under $OUT/<release>/work),
# PYTEST_FILES (default tests/python: the whole suite; a subset is named in the table).
set -uo pipefail

# The newest patch of each minor release in attnstash/_library.py's SUPPORTED_TORCH
# (checked below). 2.13.0 resolves to the CPU wheel where one lies on disk.
RELEASES=(2.11.0 2.12.1 2.13.0 2.14.1 2.15.0)

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${TORCH_MATRIX_CACHE:-$HOME/.cache/attnstash-torch-matrix}
OUT=$(mkdir -p "${OUT:-$ROOT/out/torch-matrix}" && cd "${OUT:-$ROOT/out/torch-matrix}" && pwd)
JOBS=${JOBS:-2}
BOOTSTRAP_PYTHON=${BOOTSTRAP_PYTHON:-python3}
PINS=$(grep -v '^[[:space:]]*\(#\|$\)' "$ROOT/tests/requirements.txt")
# Every version is pinned exactly; a site-wide pip constraint (a machine may cap torch at the
# releases it keeps on disk) could only refuse one.
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

# The releases must cover the declared range, one per minor release.
read -r LO HI < <(sed -n 's/^SUPPORTED_TORCH = ((\([0-9]*\), \([0-9]*\)), (\([0-9]*\), \([0-9]*\)))$/\1.\2 \3.\4/p' \
  "$ROOT/attnstash/_library.py")
minors=$(printf '%s\n' "${RELEASES[@]}" | cut -d. -f1,2 | tr '\n' ' ')
want=$(for ((m = ${LO#*.}; m <= ${HI#*.}; m++)); do printf '2.%s ' "$m"; done)
if [ -z "$LO" ] || [ "${LO%%.*}" != 2 ] || [ "${HI%%.*}" != 2 ] || [ "$minors" != "$want" ]; then
  echo "tests/torch_matrix.sh: RELEASES (minor releases: $minors) do not match SUPPORTED_TORCH in" \
       "attnstash/_library.py (${LO:-?} to ${HI:-?}): update RELEASES." >&2
  exit 2
fi

[ $# -gt 0 ] && RELEASES=("$@")
mkdir -p "$CACHE"

# One line per release in $OUT/results.md: release $1's line (torch $1 or $1+local) replaced
# by $2, sorted by release.
record() {
  local table="$OUT/results.md" rows
  rows=$( (grep '^| [0-9]' "$table" 2>/dev/null | grep -v -E "^\| ${1//./\\.}(\+[^ ]*)? \|"; echo "$2") |
         sort -t'|' -k2,2V)
  {
    echo "CPU suite per torch release (tests/torch_matrix.sh; $(uname -m), Python $("$BOOTSTRAP_PYTHON" -c 'import platform; print(platform.python_version())'), $(nproc) cores)."
    echo
    echo "| torch | build | ctest | pytest | minutes |"
    echo "|---|---|---|---|---|"
    echo "$rows"
  } > "$table.tmp" && mv "$table.tmp" "$table"
}

# "N passed, N failed" from ctest's log.
ctest_counts() {
  local line total failed
  line=$(grep -E '^[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$1" | tail -1)
  [ -z "$line" ] && { echo "did not run"; return; }
  failed=$(sed -E 's/.* ([0-9]+) tests? failed.*/\1/' <<< "$line")
  total=$(sed -E 's/.* out of ([0-9]+).*/\1/' <<< "$line")
  echo "$((total - failed)) passed, $failed failed"
}

# "N passed, N failed, N skipped[, N xfailed]" from pytest's JUnit XML (errors count as
# failed; JUnit counts an expected failure as skipped, with type pytest.xfail).
pytest_counts() {
  "$BOOTSTRAP_PYTHON" - "$1" <<'EOF' 2>/dev/null || echo "did not finish"
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
s = root if root.tag == "testsuite" else root.find("testsuite")
n, f, e, k = (int(s.get(a, 0)) for a in ("tests", "failures", "errors", "skipped"))
x = sum(1 for skip in s.iter("skipped") if skip.get("type") == "pytest.xfail")
print(f"{n - f - e - k} passed, {f + e} failed, {k - x} skipped" + (f", {x} xfailed" if x else ""))
EOF
}

status=0
for release in "${RELEASES[@]}"; do
  start=$(date +%s)
  logs="$OUT/$release"
  work="$logs/work"
  rm -rf "$logs" && mkdir -p "$work/src"
  venv="$work/venv" src="$work/src" build="$work/build"
  py="$venv/bin/python"
  echo "== torch $release (logs: $logs)"
  build_ok=no ctest_res="not run" pytest_res="not run" found=$release

  # The cache: fetched once per release (pip skips the files it already has).
  if "$BOOTSTRAP_PYTHON" -m pip download -q -d "$CACHE" "torch==$release" $PINS > "$logs/download.log" 2>&1 &&
     "$BOOTSTRAP_PYTHON" -m pip wheel -q --no-deps -w "$CACHE" $(grep -o '^deepspeed==[^ ]*' <<< "$PINS") \
       >> "$logs/download.log" 2>&1 &&
     "$BOOTSTRAP_PYTHON" -m venv "$venv" &&
     "$py" -m pip install -q --no-index --find-links "$CACHE" "torch==$release" $PINS > "$logs/install.log" 2>&1; then
    found=$("$py" -c 'import torch; print(torch.__version__)' 2>> "$logs/install.log" || echo "$release")
    # The working tree as it is now (tracked and untracked files, not the ignored builds).
    (cd "$ROOT" && git ls-files -z -c -o --exclude-standard |
       tar --null --no-recursion --ignore-failed-read -T - -cf - 2> /dev/null) | tar -xf - -C "$src"
    if make -C "$src" build NO_VENV=1 PYTHON="$py" BUILD_DIR="$build" JOBS="$JOBS" > "$logs/build.log" 2>&1; then
      build_ok=ok
      ctest --test-dir "$build" --output-on-failure -j "$JOBS" > "$logs/ctest.log" 2>&1
      ctest_res=$(ctest_counts "$logs/ctest.log")
      (cd "$src" && timeout 3h "$py" -m pytest ${PYTEST_FILES:-tests/python} -q -p no:cacheprovider \
         --junitxml="$logs/pytest.xml" > "$logs/pytest.log" 2>&1)
      pytest_res=$(pytest_counts "$logs/pytest.xml")
      [ -n "${PYTEST_FILES:-}" ] && pytest_res="$pytest_res (only ${PYTEST_FILES//tests\/python\//})"
    else
      build_ok="failed: $(grep -m1 -E -A1 ': error: |CMake Error|undefined reference' "$logs/build.log" |
                          tr -s ' \n' ' ' | cut -c1-160 | tr '|' '/')"
    fi
  else
    build_ok="not installed (download.log, install.log)"
  fi
  [ "$build_ok" = ok ] && [[ "$ctest_res" == *" 0 failed" ]] && [[ "$pytest_res" == *" 0 failed,"* ]] || status=1
  record "$release" "| $found | $build_ok | $ctest_res | $pytest_res | $((($(date +%s) - start + 30) / 60)) |"
  tail -1 "$OUT/results.md"
  [ "${KEEP:-0}" = 1 ] || rm -rf "$work"
done
echo "== $OUT/results.md; wheel cache $CACHE: $(du -sh "$CACHE" | cut -f1)"
exit $status
