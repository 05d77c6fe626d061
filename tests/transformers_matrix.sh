#!/usr/bin/env bash
# The Hugging Face tests (the Makefile's HF_TESTS) on each transformers release of the
# supported range: 4.57.6 and the newest patch of every 5.x minor. Not part of CI (`make test`
# runs the pinned release and the Makefile's HF_ALSO); about 2 minutes a release on two
# cores, up to 8 on shared ones.
#
#   bash tests/transformers_matrix.sh               every release in RELEASES below
#   bash tests/transformers_matrix.sh 5.20.2 5.24.0  only these
#   make transformers-matrix [TRANSFORMERS_MATRIX="5.20.2 5.24.0"]
#
# One venv ($OUT/venv, kept between runs) holds the test pins of tests/requirements.txt and the
# Makefile's torch; each release is installed into it in turn and the tests run against the
# tree's own build (PYTHONPATH), so `make build` comes first. One line per release goes to
# $OUT/results.md (a rerun replaces it), the log to $OUT/<release>.log.
#
# Environment: OUT (default out/transformers-matrix), PYTHON (the interpreter that makes the
# venv; its torch version is the one the tree was built for), TORCH (default torch==2.13.0).
set -uo pipefail

# 4.57.6 and the newest patch of each minor from 5.0 to the top of
# attnstash/install/transformers_adapter.py's SUPPORTED (checked below).
RELEASES=(4.57.6 5.0.0 5.1.0 5.2.0 5.3.0 5.4.0 5.5.4 5.6.2 5.7.0 5.8.1 5.9.0 5.10.4 5.11.0 5.12.1 5.13.1 5.14.1
          5.15.1 5.16.1 5.17.0 5.18.0 5.19.0 5.20.2 5.21.1 5.22.2 5.23.0 5.24.0 5.25.0)

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${OUT:-$ROOT/out/transformers-matrix}" && cd "${OUT:-$ROOT/out/transformers-matrix}" && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
TORCH=${TORCH:-torch==2.13.0}
PINS=$(make -s --no-print-directory -C "$ROOT" print-hf-pins)  # what the Makefile's hf-venvs install
HF_TESTS=$(make -s --no-print-directory -C "$ROOT" print-hf-tests)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

read -r HI_MINOR < <(sed -n 's/^SUPPORTED = ((4, 57), (5, \([0-9]*\)))$/\1/p' "$ROOT/attnstash/install/transformers_adapter.py")
minors=$(printf '%s\n' "${RELEASES[@]}" | grep '^5\.' | cut -d. -f2 | tr '\n' ' ')
want=$(for ((m = 0; m <= ${HI_MINOR:-0}; m++)); do printf '%s ' "$m"; done)
if [ -z "${HI_MINOR:-}" ] || [ "$minors" != "$want" ]; then
  echo "tests/transformers_matrix.sh: RELEASES (5.x minors: $minors) do not match SUPPORTED in" \
       "attnstash/install/transformers_adapter.py (4.57 to 5.${HI_MINOR:-?}): update RELEASES." >&2
  exit 2
fi
[ $# -gt 0 ] && RELEASES=("$@")

VENV=$OUT/venv
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV" || exit 1
fi
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install --quiet "$TORCH" $PINS || exit 1

record() {  # release $1's line replaced by $2, sorted by release
  local table="$OUT/results.md" rows
  rows=$( (grep '^| [0-9]' "$table" 2>/dev/null | grep -v -E "^\| ${1//./\\.} \|"; echo "$2") | sort -t'|' -k2,2V)
  {
    echo "The Hugging Face tests per transformers release (tests/transformers_matrix.sh; $("$VENV/bin/python" -c \
      'import torch, platform; print(f"torch {torch.__version__}, Python {platform.python_version()}")'), $(uname -m), $(nproc) cores)."
    echo
    echo "| transformers | pytest |"
    echo "|---|---|"
    echo "$rows"
  } > "$table.new" && mv "$table.new" "$table"
}

rc=0
for release in "${RELEASES[@]}"; do
  log=$OUT/$release.log
  echo "== transformers $release"
  # Packages that only some releases require go first, so that each release runs with what it
  # requires itself (kernels: 5.25 requires it, and 5.0 to 5.10 fail to import beside its release).
  "$VENV/bin/python" -m pip uninstall --quiet -y kernels > "$log" 2>&1
  # (with datasets and huggingface_hub, so that pip moves them to releases that go with this one:
  # transformers 4.57 needs huggingface_hub < 1, which the newest datasets does not take)
  if ! "$VENV/bin/python" -m pip install --quiet "transformers==$release" datasets huggingface_hub >> "$log" 2>&1; then
    record "$release" "| $release | install failed (see $release.log) |"; rc=1; continue
  fi
  start=$(date +%s)
  # shellcheck disable=SC2086
  (cd "$ROOT" && PYTHONPATH=$ROOT "$VENV/bin/python" -m pytest $HF_TESTS -q -p no:cacheprovider) >> "$log" 2>&1
  status=$?
  summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ in [0-9.]*s.*//')
  echo "   ${summary:-no summary} ($(( $(date +%s) - start )) s)"
  record "$release" "| $release | ${summary:-no summary (see $release.log)} |"
  [ $status -eq 0 ] || rc=1
done
echo "results: $OUT/results.md"
exit $rc
