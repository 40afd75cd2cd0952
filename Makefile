# The two commands in README.md: `make demo` and `make test`. Both bootstrap .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Pinned so that pip takes this machine's local CPU wheel in seconds; on a GPU machine the same
# spec pulls PyPI's CUDA build. Override, e.g. TORCH_SPEC="torch==2.13.0 --index-url URL".
TORCH_SPEC ?= torch==2.13.0
PEERS ?= 4
ROUNDS ?= 8

.PHONY: demo test test-unit test-integration faults bench lint bootstrap clean

bootstrap: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $@

demo: bootstrap
	$(BIN)/workbench demo --peers $(PEERS) --rounds $(ROUNDS)

test: bootstrap
	$(BIN)/python -m pytest -q -m "not faults"

# Slow fault scenarios (a frozen straggler, ...), each printing what it survived.
faults: bootstrap
	$(BIN)/python -m pytest -q -m faults -rA

test-unit: bootstrap
	$(BIN)/python -m pytest -q tests/unit

test-integration: bootstrap
	$(BIN)/python -m pytest -q tests/integration

bench: bootstrap
	$(BIN)/python -m benchmarks.train_step
	$(BIN)/python -m benchmarks.optimizers --quick

lint: bootstrap
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
