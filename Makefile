# Every target installs what it needs into the project venv first, so a fresh clone needs only
# `make demo` or `make test`. An existing .venv is reused (torch alone is ~6 GB).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed-stamp
DEMO_DIR ?= demo-out

.PHONY: install demo docs test test-all test-realwidth test-realwidth-ci test-vllm test-vllm-evs vllm-qaic-src lint golden clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(BIN)/pip install --quiet --upgrade pip
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(BIN)/pip install --quiet -e '.[test,docs]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/python -m qeff_vision.demo --out $(DEMO_DIR)

# Fast tier (the default): tiny random checkpoints only. `make test-all` adds the slow tier.
# pytest-xdist runs TEST_WORKERS processes (CI has 2 cores; `auto` is one per core), each with torch
# and onnxruntime on one thread (tests/conftest.py); pytest still exits 5 when no test ran.
TEST_WORKERS ?= 2

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) tests
	$(BIN)/qeff-vision specialize --check specs/
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --quiet -d $(CURDIR)/build/site-check

# The documentation site (mkdocs.yml, sources under docs/; family and spec-key pages generated at
# build time by tools/docs_site/hooks.py) into site/.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

test-all: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) -m "not realwidth" tests

# Real-width tier (tests/test_real_width.py): every family's pinned config with every width kept and
# only depth, vocabulary and experts cut, compiled with --backend onnxruntime and the default
# precision plan and run against transformers, one process per family (cost in docs/guide/testing.md).
test-realwidth: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -m realwidth tests/test_real_width.py

# The real-width subset .ci/run runs (issue 48): one family per state kind. gemma4: full attention,
# sliding ring and shared KV; llama4: chunked ring and routed experts; qwen3_5_moe: recurrent (Gated
# DeltaNet) and experts; kimi_k25: latent (MLA). mllama, the only cross-attention decoder, costs more
# than the four together and stays in `make test-realwidth` (figures in docs/guide/testing.md).
REALWIDTH_CI ?= gemma4 or llama4 or qwen3_5_moe or kimi_k25

test-realwidth-ci: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -m realwidth tests/test_real_width.py \
		-k "test_real_width_family_matches_transformers and ($(REALWIDTH_CI))"

lint: install
	$(BIN)/ruff check qeff_vision tests benchmarks tools
	$(BIN)/ruff format --check qeff_vision tests benchmarks tools

golden: install
	$(BIN)/qeff-vision specialize --update-golden specs/

clean:
	rm -rf $(DEMO_DIR) build site *.egg-info

# Opt-in tier: the real vLLM 0.23.0 + Qualcomm's vllm-qaic plugin serving our onnxruntime-compiled
# artifacts over the device-runtime stand-in (tests/device_double). VLLM_QAIC_SRC is a checkout of
# github.com/qualcomm/vllm-qaic; its entry points are declared by tests/vllm_tier/shim (the
# plugin's setup.py needs the SDK) and a .pth puts the checkout on the venv's path.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP = $(VLLM_VENV)/.installed-stamp

$(VLLM_STAMP): tests/vllm_tier/shim/pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet vllm==0.23.0 transformers==5.5.4 peft onnxruntime pyyaml timm==1.0.14 qwen-vl-utils==0.0.8
	$(VLLM_VENV)/bin/pip install --quiet ./tests/vllm_tier/shim
	rm -rf tests/vllm_tier/shim/build tests/vllm_tier/shim/*.egg-info
	$(VLLM_VENV)/bin/python -c "import sysconfig, pathlib; pathlib.Path(sysconfig.get_paths()['purelib'], 'vllm_qaic_src.pth').write_text(\"import os, sys; _p = os.environ.get('VLLM_QAIC_SRC'); _p and _p not in sys.path and sys.path.append(_p)\\n\")"
	touch $(VLLM_STAMP)

vllm-qaic-src:
	@test -n "$(VLLM_QAIC_SRC)" -a -d "$(VLLM_QAIC_SRC)/vllm_qaic" || { echo "set VLLM_QAIC_SRC to a checkout of github.com/qualcomm/vllm-qaic" >&2; exit 2; }

test-vllm: vllm-qaic-src install $(VLLM_STAMP)
	QEFF_VLLM_TIER=1 VLLM_VENV=$(abspath $(VLLM_VENV)) VLLM_QAIC_SRC=$(abspath $(VLLM_QAIC_SRC)) \
		$(BIN)/python -m pytest -q -p no:cacheprovider tests/vllm_tier

# Opt-in check of video pruning against vLLM's own EVS functions (tests/test_video_pruning_vllm.py;
# the default tier compares with their recorded outputs). Only vllm/multimodal/video_prune/evs.py
# is used, which needs torch alone: vLLM goes in without its dependencies, and a .pth line lends
# it the project venv's torch.
EVS_VENV ?= .venv-vllm-evs
EVS_STAMP = $(EVS_VENV)/.installed-stamp

$(EVS_STAMP): | $(STAMP)
	test -x $(EVS_VENV)/bin/python || $(BIN)/python -m venv $(EVS_VENV)
	$(BIN)/python -c "import sysconfig, pathlib, subprocess; target = subprocess.check_output(['$(EVS_VENV)/bin/python', '-c', 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'], text=True).strip(); pathlib.Path(target, 'project_venv.pth').write_text(sysconfig.get_paths()['purelib'] + '\\n')"
	$(EVS_VENV)/bin/pip install --quiet --no-deps vllm==0.33.0
	touch $(EVS_STAMP)

test-vllm-evs: install $(EVS_STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_video_pruning_vllm.py
