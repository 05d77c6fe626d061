#!/usr/bin/env bash
# LLaMA-Factory and axolotl, each in a venv of its own (they pin transformers releases other than
# the test environment's: LLaMA-Factory 0.9.5 accepts at most 5.6.0, axolotl 0.19.0 exactly 5.16.1),
# run by tests/tools/test_lf_axolotl.py: `make test-tools`. Each venv gets the Makefile's torch, the
# tool and pytest, and uses the tree's own build (PYTHONPATH; the same torch), with ATTNSTASH_LAYERS's
# start-up line in its site-packages. A venv is made once per requirement list (a stamp file) and
# removed once its tests have run unless KEEP_VENVS is set (the Makefile's KEEP_VENVS says why).
#
# LLaMA-Factory imports torchvision and torchaudio, whose PyPI wheels for torch 2.13 are CUDA builds
# that do not load next to the CPU torch: torchvision is removed from its venv (text training does not
# use it) and torchaudio's compiled libraries moved aside (then it imports without them).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BOOTSTRAP_PYTHON=${BOOTSTRAP_PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
declare -A TOOL=(
  [llamafactory]="$TORCH llamafactory==0.9.5 transformers==5.6.0 pytest==9.2.0"
  [axolotl]="$TORCH axolotl==0.19.0 pytest==9.2.0"
)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

venv() {  # $1: the tool; makes $ROOT/.venv-$1 with ${TOOL[$1]}
  local dir=$ROOT/.venv-$1 want=${TOOL[$1]}
  [ -x "$dir/bin/python" ] || "$BOOTSTRAP_PYTHON" -m venv "$dir"
  if [ "$(cat "$dir/.attnstash-requirements" 2>/dev/null)" != "$want" ]; then
    echo "== installing into $dir: $want"
    # shellcheck disable=SC2086
    "$dir/bin/python" -m pip install --quiet -c <(echo "$TORCH") $want
    if [ "$1" = llamafactory ]; then
      "$dir/bin/python" -m pip uninstall --quiet -y torchvision
      local audio
      audio=$("$dir/bin/python" -c 'import importlib.util, os; s = importlib.util.find_spec("torchaudio"); print(os.path.join(os.path.dirname(s.origin), "lib") if s else "")')
      if [ -n "$audio" ] && [ -d "$audio" ]; then mkdir -p "$dir/torchaudio-lib-aside" && mv "$audio"/*.so "$dir/torchaudio-lib-aside/" 2>/dev/null || true; fi
    fi
    echo "$want" > "$dir/.attnstash-requirements"
  fi
  cp "$ROOT/attnstash/integrations/attnstash-autostash.pth" \
    "$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
}

rc=0
for tool in llamafactory axolotl; do
  venv "$tool"
  echo "== $tool"
  (cd "$ROOT" && PYTHONPATH=$ROOT "$ROOT/.venv-$tool/bin/python" -m pytest tests/tools/test_lf_axolotl.py -q \
     -p no:cacheprovider -rs) || rc=1
  [ -n "${KEEP_VENVS:-}" ] || rm -rf "$ROOT/.venv-$tool"
done
exit $rc
