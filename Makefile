# Two commands that work on a fresh machine: `make demo` (the main job) and `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch lies on this machine's disk; a looser pin would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[dev]'
	# matplotlib builds its font cache on first import by running fc-list: a unit test must start no process
	$(BIN)/python -c "import matplotlib.font_manager"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/paratrain train --config configs/demo.json --nproc-per-node 2

# -rs: every skipped test prints its reason (CI also fails a skipped DeepSpeed comparison: .ci/run);
# --durations: the slowest tests, to keep the suite inside its 25 minutes
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/pytest -rs --durations=20

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m benchmarks.suite

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
