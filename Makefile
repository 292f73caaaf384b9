# Developer and CI entry points. `make test` is the test command (.ci/run calls it); it builds .venv on first use.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp
LIB := dali_fastai
# pytest-xdist workers: the CI box has 2 cores
N ?= 2
# torch and torchvision, installed together from the package registry before the project: a local wheel directory
# (pip's find-links) may offer a CPU torch with no matching torchvision. The pair below is the one the project is
# tested with; another build: `make venv TORCH_PKGS="torch==X torchvision==Y"` (after `rm $(STAMP)`).
TORCH_PKGS ?= torch==2.15.0 torchvision==0.29.2
PIP := $(BIN)/python -m pip --disable-pip-version-check --no-input
PIP_INSTALL := $(PIP) install --quiet --progress-bar off
# pip warns once per package about `file://` extra indexes that lack it; that is noise, not news
QUIET_PIP := { grep -v -e 'is ignored: it is neither a file nor a directory' >&2 || true; }

.PHONY: help venv test demo export clean settings readme gpu-test mutants

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  make %-9s %s\n", $$1, $$2}'

venv: $(STAMP)  ## create .venv (python3 -m venv) with torch, torchvision and this package installed editable, with [dev]

# The stamp holds a checksum of pyproject.toml: nbdev-export rewrites that file (same content, new mtime) on every run,
# and an mtime-only stamp would reinstall on each `make test`.
$(STAMP): pyproject.toml
	@key="$$(cksum < pyproject.toml) $(TORCH_PKGS)"; \
	if [ -f $@ ] && [ "$$(cat $@)" = "$$key" ]; then touch $@; exit 0; fi; \
	test -x $(BIN)/python || { echo "== $(PYTHON) -m venv $(VENV)"; $(PYTHON) -m venv $(VENV); }; \
	free="$$(df -Pk $(VENV) | awk 'NR==2 {print int($$4/1048576)}')"; \
	if [ "$$free" -lt 8 ]; then echo "== warning: $$free GiB free on the disk of $(VENV); torch and torchvision take about 7 GiB" \
	  "there (a CUDA build): pip may stop with 'No space left on device'" >&2; fi; \
	echo "== pip install $(TORCH_PKGS)  (from the registry; several GB the first time)"; \
	$(PIP_INSTALL) $(TORCH_PKGS) 2>&1 | $(QUIET_PIP); \
	echo '== pip install -e ".[dev]"'; \
	$(PIP_INSTALL) $(TORCH_PKGS) -e ".[dev]" 2>&1 | $(QUIET_PIP); \
	$(BIN)/python -c 'import torch, torchvision, nvidia.dali, fastai, nbdev; print("== venv ready: torch", torch.__version__, "| torchvision", torchvision.__version__, "| DALI", nvidia.dali.__version__, "| fastai", fastai.__version__, "| nbdev", nbdev.__version__)'; \
	echo "$$key" > $@

test: venv  ## the test command: exported modules match the notebooks, then pytest (notebooks included) on CPU
	@echo "== nbdev-export: the committed $(LIB)/ must be what the notebooks export"
	@env -u IN_TEST $(BIN)/nbdev-export
	@changed="$$(git status --porcelain -- $(LIB))"; if [ -n "$$changed" ]; then \
	  echo "nbdev-export changed $(LIB)/: export the notebooks and commit the result with them:"; echo "$$changed"; \
	  git --no-pager diff --stat -- $(LIB); exit 1; fi
	@echo "== pytest -n $(N) tests  (per-test timeout: [tool.pytest.ini_options] in pyproject.toml)"
	$(BIN)/python -m pytest -n $(N) -ra --durations=30 tests

# The embedded Fashion-MNIST sample at its native 28 px (the command's default, 64 px, upsamples it and takes ~5x longer):
# a few minutes of training on 2 cores (about 148 s on a busy 2-core machine, issue 41). Each step says how long it took:
# the venv, then the command (its first line: loaders and model, imports included; one line an epoch; the last: the
# training).
demo:  ## train resnet18 for 2 epochs on the embedded data (28 px) on the CPU through the command line, timing each step
	@t=$$(date +%s); $(MAKE) --no-print-directory venv; echo "== venv ready in $$(( $$(date +%s) - t ))s"
	@t=$$(date +%s); echo "== $(BIN)/dali-fastai train --epochs 2 --size 28 --device cpu"; \
	$(BIN)/dali-fastai train --epochs 2 --size 28 --device cpu; \
	echo "== demo: dali-fastai train took $$(( $$(date +%s) - t ))s in all (imports, loaders, model, 2 epochs)"

export: venv  ## nbdev-export: notebooks -> dali_fastai/
	$(BIN)/nbdev-export

clean: venv  ## nbdev-clean: strip notebook metadata and execution counts
	$(BIN)/nbdev-clean

settings:  ## regenerate settings.ini from pyproject.toml
	$(PYTHON) tools/settings_ini.py

readme:  ## regenerate README.md from nbs/index.ipynb
	$(PYTHON) tools/readme.py

# The GPU machine has no .venv and no network: `make gpu-test PY=python3` uses that python (torch, pytest, pytest-xdist,
# pytest-timeout there; DALI, fastai, fastcore, nbdev and the rest of the [dev] extra on PYTHONPATH: tests/conftest.py
# names any that is missing before a test runs) and builds nothing. Without PY: the .venv's python. Each test builds
# its own GPU pipelines, so it is slow: on two H100s and 32 cores (2026-11-25), steps 1 and 3 side by side at N=14 took
# over 7 minutes each, step 2 alone 2.7.
PY ?=
GPU_PY = $(or $(PY),$(BIN)/python)
# GPU tests fail, not skip, when no GPU is visible (tests/conftest.py stops the run first)
GPU_ENV := DALI_FASTAI_GPU_TESTS=1 DALI_FASTAI_NB_SKIP_FLAGS=notest

gpu-test: $(if $(PY),,venv)  ## on the GPU machine: every GPU test (`gpu` tests, notebooks' `#| cuda` cells, decoders on the GPU)
	@echo "== GPU: tests marked gpu, notebooks with their #| cuda cells"
	$(GPU_ENV) $(GPU_PY) -m pytest -n $(N) -ra -m 'gpu and not gpu_alone' tests
	@echo "== GPU: tests that read the whole GPU's free memory, alone"
	$(GPU_ENV) $(GPU_PY) -m pytest -p no:xdist -ra -m gpu_alone tests
	@echo "== GPU: unusual images, the default augmentations, boxes and points, decode_on through the GPU backend"
	$(GPU_ENV) DALI_FASTAI_TEST_DEVICE=gpu $(GPU_PY) -m pytest -n $(N) -ra tests/test_files.py tests/test_defaults.py tests/test_box_geometry.py tests/test_masks.py tests/test_shards.py tests/test_mask_sampling.py tests/test_session.py tests/test_decode_on.py

mutants: venv  ## plant known bugs in a copy of the package; every one must fail a test (slow: not part of `test`)
	$(BIN)/python tools/mutants.py
