# Every target installs what it needs into the project venv first, so a fresh clone needs only
# `make demo` or `make test`. An existing .venv is reused (torch alone is ~6 GB).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed-stamp
DEMO_DIR ?= demo-out

.PHONY: install demo test test-all lint golden clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/python -m qeff_vision.demo --out $(DEMO_DIR)

# Fast tier (the default): tiny random checkpoints only. `make test-all` adds the slow tier.
test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests
	$(BIN)/qeff-vision specialize --check specs/

test-all: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "slow or not slow" tests

lint: install
	$(BIN)/ruff check qeff_vision tests benchmarks
	$(BIN)/ruff format --check qeff_vision tests benchmarks

golden: install
	$(BIN)/qeff-vision specialize --update-golden specs/

clean:
	rm -rf $(DEMO_DIR) build *.egg-info
