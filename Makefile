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

.PHONY: lab test lint build check bench doctor grade-setup site clean

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

# What `kit grade --out` needs to sandbox each submission: as root, bubblewrap (and util-linux's
# setpriv), installed with apt-get when missing; then the grader's own probe says what it gives.
# As root without a working sandbox `kit grade` refuses to grade (unless --unsandboxed).
grade-setup: $(STAMP)
	@if command -v bwrap >/dev/null 2>&1 && command -v setpriv >/dev/null 2>&1; then \
	  echo "grade-setup: bubblewrap and setpriv are installed"; \
	elif [ "$$(id -u)" != 0 ]; then \
	  echo "grade-setup: bubblewrap is not installed and you are not root: run 'sudo make grade-setup'" \
	       "(or 'sudo apt-get install bubblewrap'), then grade as root for a sandbox per submission;" \
	       "as you, kit grade runs each submission as your user (it says so in one line)" >&2; \
	  exit 1; \
	elif command -v apt-get >/dev/null 2>&1; then \
	  echo "grade-setup: apt-get install bubblewrap util-linux"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap util-linux >/dev/null; \
	else \
	  echo "grade-setup: no apt-get here: install bubblewrap (bwrap) and util-linux (setpriv) with this" \
	       "system's package manager" >&2; \
	  exit 1; \
	fi
	@$(BIN)/python -c "import sys; from autograder.grade import sandbox as s; why = s.refusal(); \
	print('grade-setup: ' + (why or s.isolation_note() or 'grading isolation: ' + s.isolation().describe()), \
	      file=sys.stderr if why else sys.stdout); sys.exit(1 if why else 0)"

# the course as a static HTML book (build/site/html/index.html), from the executed lessons the
# headless tests keep in build/executed/ (a lesson without one is executed once)
site: $(STAMP)
	$(BIN)/python -m autograder.site

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
