# Two commands run everything (see README):
#   make lab    bootstrap .venv if needed, then open the course in JupyterLab
#   make test   bootstrap .venv if needed, then run the test suite
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
# pytest-xdist workers for `make test` (0: one process). Most tests leave a core idle while
# ranks start, kernels boot or a hang times out, so two workers finish the suite sooner on 2
# cores (2,028 s against 2,394 s in one process); tests/conftest.py keeps the files that must
# share a worker together.
TEST_WORKERS ?= 2
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: lab test lint build check bench doctor site clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: otherwise pip may pick a multi-GB CUDA build on its own.
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(STAMP)

lab: $(STAMP)
	$(BIN)/kit lab

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check kit autograder tests benchmarks solutions

build: $(STAMP)
	$(BIN)/kit build

check: $(STAMP)
	$(BIN)/kit build --check

bench: $(STAMP)
	$(BIN)/python benchmarks/launch_latency.py

doctor: $(STAMP)
	$(BIN)/kit doctor

# the course as a static HTML book (build/site/html/index.html), from the executed lessons the
# headless tests keep in build/executed/ (a lesson without one is executed once)
site: $(STAMP)
	$(BIN)/python -m autograder.site

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
