# attnstash: every command a developer or CI needs. Each target does its own set-up.
#
#   make demo       the main job: fine-tune a small decoder without and with the stash
#   make test       venv + build + GoogleTest (ctest) + pytest; the Hugging Face tests again
#                   under each transformers of HF_ALSO; timm; LLaMA-Factory and axolotl (a venv each,
#                   removed once its tests have run unless KEEP_VENVS=1)
#   make sanitize   the C registry suite under ASan+UBSan, and under TSan
#   make bench      python -m benchmarks (BENCH_ARGS="--mode layer", "--mode soak", ...)
#   make sweep      every model type of each transformers, and every diffusers model class
#   make torch-matrix   the CPU suite on each torch release of the supported range (not in CI)
#   make transformers-matrix   the Hugging Face tests on each transformers minor of the range (not in CI)
#   make build      only (re)build attnstash/_C into the venv
#   make check      the fast inner loop: build, ctest and the op-level pytest files (CHECK_TESTS; under a minute)
#
# Another torch: make test TORCH=torch==2.14.1 VENV=.venv-214
# Another transformers: make test TRANSFORMERS=transformers==4.57.6 VENV=.venv-4.57
# An existing Python with torch (no venv, no installs): make test PYTHON=python3 NO_VENV=1

BOOTSTRAP_PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# The test environment's pins: one file (pyproject.toml's `test` extra names it too).
PINS := $(shell grep -v '^[[:space:]]*\(#\|$$\)' tests/requirements.txt)
TRANSFORMERS ?= $(filter transformers==%,$(PINS))
# The transformers releases the Hugging Face tests run on besides the pinned one (a venv each).
HF_ALSO ?= 4.57.6 5.17.0 5.24.0
# Pins a venv leaves out. The venvs of other transformers releases (hf-venvs, and
# tests/transformers_matrix.sh through print-hf-pins) leave out diffusers, whose release needs a
# huggingface_hub that transformers 4.57 refuses; the diffusers tests run in the main venv.
WITHOUT ?=
HF_WITHOUT := diffusers==%
REQUIREMENTS = $(TORCH) $(TRANSFORMERS) $(filter-out transformers==% $(WITHOUT),$(PINS))
PYTHON ?= $(VENV)/bin/python
BUILD_DIR ?= build/$(notdir $(VENV))
PYTEST_ARGS ?=
JOBS ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: all venv gtest build check demo bench test test-cpp test-python print-hf-tests print-hf-pins hf-venvs test-hf-also test-timm test-tools sweep torch-matrix transformers-matrix sanitize clean
all: test

venv:
ifndef NO_VENV
	@test -x $(PYTHON) || $(BOOTSTRAP_PYTHON) -m venv $(VENV)
	@if [ "$$(cat $(VENV)/.attnstash-requirements 2>/dev/null)" != '$(REQUIREMENTS)' ]; then \
	  echo "== installing into $(VENV): $(REQUIREMENTS)"; \
	  $(PYTHON) -m pip install --quiet --disable-pip-version-check $(REQUIREMENTS) && \
	  echo '$(REQUIREMENTS)' > $(VENV)/.attnstash-requirements; \
	fi
endif

# GoogleTest from Debian's libgtest-dev, installed when missing and apt can.
gtest:
	@if [ ! -f /usr/include/gtest/gtest.h ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "== installing libgtest-dev"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgtest-dev >/dev/null; \
	  else \
	    echo "GoogleTest is missing and cannot be installed here: install libgtest-dev (Debian/Ubuntu) and re-run." >&2; exit 1; \
	  fi; \
	fi

# An editable install leaves out ATTNSTASH_LAYERS's start-up line (pip puts it in site-packages
# for a regular install): copied there by hand.
build: venv gtest
	ATTNSTASH_BUILD_DIR=$(abspath $(BUILD_DIR)) ATTNSTASH_BUILD_TESTS=1 CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) \
	  $(PYTHON) -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e .
	@cp attnstash/integrations/attnstash-autostash.pth "$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"

# The main job: fine-tune a small decoder twice, without and with the stash (about a minute).
DEMO_ARGS ?=
demo: build
	$(PYTHON) examples/demo.py $(DEMO_ARGS)

BENCH_ARGS ?=
bench: build
	$(PYTHON) -m benchmarks $(BENCH_ARGS)

test-cpp: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS)

test-python: build
	$(PYTHON) -m pytest tests/python -q $(PYTEST_ARGS)

# The fast inner loop, from a built tree: the C core's ctest and the op-level tests, which need
# only torch and attnstash, not transformers (their generic helpers: tests/python/helpers.py), and the
# installer on plain PyTorch models (test_any_model.py).
CHECK_TESTS = tests/python/test_sdpa_ops_bitwise.py tests/python/test_sdpa_ops_phases.py tests/python/test_sdpa_ops_entry.py \
  tests/python/test_sdpa_ops_refusals.py tests/python/test_sdpa_ops_compile.py tests/python/test_compile.py \
  tests/python/test_errors.py tests/python/test_edge_inputs.py tests/python/test_info.py tests/python/test_any_model.py \
  tests/python/test_module_hooks.py tests/python/test_checkpoint_inputs.py \
  tests/python/test_install_mid_step.py tests/python/test_recomputed.py
check: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS)
	$(PYTHON) -m pytest $(CHECK_TESTS) -q $(PYTEST_ARGS)

# The tests that depend on transformers, again under each release of HF_ALSO: the same
# extension (same torch, same Python) imported from the source tree.
HF_TESTS = tests/python/test_huggingface_training.py tests/python/test_huggingface_refusals.py \
  tests/python/test_huggingface_install.py tests/python/test_training_setups.py tests/python/test_trainer.py \
  tests/python/test_plan_measured.py tests/python/test_plan_command.py tests/python/test_plan_cuda.py \
  tests/python/test_model_sweep.py tests/python/test_budget.py tests/python/test_huggingface_dropout.py \
  tests/python/test_plan_quiet.py tests/python/test_plan_independent.py tests/python/test_plan_refused_for_cuda.py \
  tests/python/test_offload_hooks.py tests/python/test_offload_own.py tests/python/test_compile_in_eager_checkpoint.py \
  tests/python/test_backward_twice.py
print-hf-tests:
	@echo $(HF_TESTS)
print-hf-pins:
	@echo $(filter-out transformers==% $(HF_WITHOUT),$(PINS))

# The venvs `make test` makes besides the main one (one per transformers of HF_ALSO, timm's, one per
# tool) take about 17 GB together, more than some CI machines have free: each is removed once its
# tests have run, so that one at a time is on disk. KEEP_VENVS=1 keeps them for the next run.
KEEP_VENVS ?=
HF_VENV = $(MAKE) --no-print-directory venv VENV=.venv-hf-$$v TRANSFORMERS=transformers==$$v TORCH=$(TORCH) WITHOUT='$(HF_WITHOUT)'

hf-venvs: build
ifndef NO_VENV
	@for v in $(HF_ALSO); do $(HF_VENV) || exit 1; done
endif

test-hf-also: build
ifndef NO_VENV
	@rc=0; for v in $(HF_ALSO); do \
	  $(HF_VENV) || exit 1; \
	  echo "== the Hugging Face tests under transformers $$v"; \
	  PYTHONPATH=$(CURDIR) .venv-hf-$$v/bin/python -m pytest $(HF_TESTS) -q -p no:cacheprovider $(PYTEST_ARGS) || rc=1; \
	  $(if $(KEEP_VENVS),,rm -rf .venv-hf-$$v;) \
	done; exit $$rc
endif

# timm needs torchvision, which does not import next to the CPU torch 2.13: its tests run in a
# venv of their own with the torch and torchvision on disk (torch 2.14.1 is in the supported
# range), attnstash built for that torch and installed there (not in place: the tree's own build
# stays the main venv's), from outside the tree so that the installed one is imported.
TIMM_VENV ?= .venv-timm
TIMM_REQUIREMENTS ?= torch==2.14.1 torchvision==0.29.1 timm==1.0.31 pytest==9.2.0 numpy==2.4.6 setuptools==80.9.0 wheel==0.45.1
test-timm: gtest
ifndef NO_VENV
	@test -x $(TIMM_VENV)/bin/python || $(BOOTSTRAP_PYTHON) -m venv $(TIMM_VENV)
	@if [ "$$(cat $(TIMM_VENV)/.attnstash-requirements 2>/dev/null)" != '$(TIMM_REQUIREMENTS)' ]; then \
	  echo "== installing into $(TIMM_VENV): $(TIMM_REQUIREMENTS)"; \
	  $(TIMM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(TIMM_REQUIREMENTS) && \
	  echo '$(TIMM_REQUIREMENTS)' > $(TIMM_VENV)/.attnstash-requirements; \
	fi
	ATTNSTASH_BUILD_DIR=$(abspath build/$(notdir $(TIMM_VENV))) CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) \
	  $(TIMM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps .
	@rc=0; (cd $(TIMM_VENV) && bin/python -m pytest $(CURDIR)/tests/python/test_timm.py -q -p no:cacheprovider $(PYTEST_ARGS)) \
	  || rc=1; $(if $(KEEP_VENVS),,rm -rf $(TIMM_VENV) build/$(notdir $(TIMM_VENV));) exit $$rc
endif

# LLaMA-Factory and axolotl pin transformers releases of their own: a venv each (tests/tools/run.sh).
test-tools: build
ifndef NO_VENV
	BOOTSTRAP_PYTHON=$(BOOTSTRAP_PYTHON) TORCH=$(TORCH) KEEP_VENVS=$(KEEP_VENVS) bash tests/tools/run.sh
endif

test: test-cpp test-python test-hf-also test-timm test-tools

# The supported-model sweep: every model type of each transformers (the pinned one and HF_ALSO),
# built tiny, trained with and without the stash, out/sweep-<version>/; and every diffusers
# model class that checkpoints its blocks, out/sweep-diffusers/.
SWEEP_ARGS ?=
sweep: hf-venvs
	@rc=0; \
	$(PYTHON) tests/python/sweep_diffusers.py --out out/sweep-diffusers || rc=1; \
	$(PYTHON) tests/python/sweep_models.py --out out/sweep-$(patsubst transformers==%,%,$(TRANSFORMERS)) $(SWEEP_ARGS) || rc=1; \
	$(if $(NO_VENV),,for v in $(HF_ALSO); do PYTHONPATH=$(CURDIR) .venv-hf-$$v/bin/python tests/python/sweep_models.py --out out/sweep-$$v $(SWEEP_ARGS) || rc=1; done;) \
	exit $$rc

# The Hugging Face tests on each transformers minor release of the supported range (not in CI:
# about 2 minutes a release on 2 cores, up to 8 on shared ones): out/transformers-matrix/results.md.
TRANSFORMERS_MATRIX ?=
transformers-matrix: build
	PYTHON=$(PYTHON) bash tests/transformers_matrix.sh $(TRANSFORMERS_MATRIX)

# The CPU suite on each minor torch release of the supported range (not in CI: about 10
# minutes a release on 2 cores, and GBs of wheels, cached in ~/.cache/attnstash-torch-matrix):
# out/torch-matrix/results.md.
TORCH_MATRIX ?=
torch-matrix: gtest
	bash tests/torch_matrix.sh $(TORCH_MATRIX)

sanitize: gtest
	cmake -S . -B build/asan -DATTNSTASH_WITH_TORCH=OFF -DATTNSTASH_BUILD_TESTS=ON \
	  -DATTNSTASH_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=Debug >/dev/null
	cmake --build build/asan -j $(JOBS) >/dev/null
	ctest --test-dir build/asan --output-on-failure -j $(JOBS)
	cmake -S . -B build/tsan -DATTNSTASH_WITH_TORCH=OFF -DATTNSTASH_BUILD_TESTS=ON \
	  -DATTNSTASH_SANITIZE=thread -DCMAKE_BUILD_TYPE=Debug >/dev/null
	cmake --build build/tsan -j $(JOBS) >/dev/null
	ctest --test-dir build/tsan --output-on-failure -j $(JOBS)

clean:
	rm -rf build attnstash/_C*.so
