# The two commands in README.md: `make demo` and `make test`. Both bootstrap .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Pinned so that pip takes this machine's local CPU wheel in seconds; on a GPU machine the same
# spec pulls PyPI's CUDA build. Override, e.g. TORCH_SPEC="torch==2.13.0 --index-url URL".
TORCH_SPEC ?= torch==2.13.0
PEERS ?= 4
ROUNDS ?= 8

.PHONY: demo test test-unit test-integration faults soak bench lint bootstrap bytecode clean

# A .venv whose interpreter no longer runs (a Python upgraded or removed under it) is made again:
# its stamp alone said "installed", and every target failed with "No such file or directory".
bootstrap:
	@$(BIN)/python -c "" 2>/dev/null || rm -f $(VENV)/.installed
	@$(MAKE) --no-print-directory $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@$(BIN)/python -c "" 2>/dev/null || $(PYTHON) -m venv --clear $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $@

# Every peer, monitor and CLI call is a fresh Python process. Where PYTHONDONTWRITEBYTECODE is
# set (this machine sets it) none of them caches its bytecode, and each compiled the project's
# modules again: about 0.4 s of CPU per process. compileall writes the caches all the same.
bytecode: bootstrap
	@$(BIN)/python -m compileall -q optim swarm workbench tui benchmarks

demo: bytecode
	$(BIN)/workbench demo --peers $(PEERS) --rounds $(ROUNDS)

# Three workers (pytest-xdist) on two cores: the integration tests wait on peers more than they
# compute, and two left a quarter of the CPU idle (890 s at -n 2, 673 s at -n 3, 2026-12-07).
# Tests in network namespaces share a worker (xdist_group).
test: bytecode
	$(BIN)/python -m pytest -q -n 3 --dist loadgroup -m "not faults and not soak"

# Slow fault scenarios (a frozen straggler, a killed donor, ...), each with a summary line:
# survived or not, rounds lost, seconds to recover (also kept in benchmarks/results/faults.json).
faults: bytecode
	WORKBENCH_FAULTS_REPORT=benchmarks/results/faults.json $(BIN)/python -m pytest -q -m faults -rA

# Churn soak: peers leave and join at random every ~20 s for SOAK_SECONDS (default 240) in a run
# of SOAK_ROUNDS rounds (default two per churn second).
soak: bytecode
	WORKBENCH_FAULTS_REPORT=benchmarks/results/soak.json $(BIN)/python -m pytest -q -m soak -rA -s

test-unit: bytecode
	$(BIN)/python -m pytest -q tests/unit

test-integration: bytecode
	$(BIN)/python -m pytest -q tests/integration

# Every benchmark, then docs/performance.md from benchmarks/results/*.json. The utilization
# benchmark needs root (network namespaces) and says so where it cannot run.
bench: bytecode
	$(BIN)/python -m benchmarks.train_step
	$(BIN)/python -m benchmarks.optimizers --quick
	$(BIN)/python -m benchmarks.allreduce
	$(BIN)/python -m benchmarks.trust
	$(BIN)/python -m benchmarks.overheads
	$(BIN)/python -m benchmarks.tui_refresh
	$(BIN)/python -m benchmarks.utilization
	$(BIN)/python -m benchmarks.report

lint: bootstrap
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
