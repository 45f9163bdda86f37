# The two commands: `make demo` (the main job) and `make test` (the whole suite). Both build .venv when needed.
# `make test-torch TORCH=2.4.1 PYTHON=3.10` proves the core suite on any torch / Python pair in its own venv.
BASE_PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/ddp-doctor: pyproject.toml constraints.txt
	$(BASE_PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $@

.PHONY: demo test lint test-torch test-transformers4 bench browser flaky
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
demo: $(BIN)/ddp-doctor
	$(BIN)/ddp-doctor demo

# The HTML tests render pages in headless Chromium (Debian's package).
browser:
	@command -v chromium >/dev/null || { echo "installing Debian's chromium for the HTML tests"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium >/dev/null; }

# ruff: lint and the format check (CI fails on either).
lint: $(BIN)/ddp-doctor
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

# Corner A: lint, then the whole suite on the pinned torch 2.13.0 / the machine's Python, integrations included:
# on WORKERS pytest-xdist workers (a check's processes leave a third of 2 cores idle, mostly while one process
# imports torch), then the tests marked serial alone (their verdicts rest on wall-clock time).
WORKERS ?= 2
# The serial part runs even when the parallel part failed (one flake must not hide the rest); either failing fails.
# The sources are compiled first: where PYTHONDONTWRITEBYTECODE is set (this machine's environment sets it), every
# process of every check would otherwise compile the package's ~180 modules anew (about 0.25 s of CPU each time).
test: lint browser
	$(BIN)/python -m compileall -q src tests
	@$(BIN)/python -m pytest -q -n $(WORKERS) -m "not serial"; par=$$?; \
	  $(BIN)/python -m pytest -q -m serial; ser=$$?; \
	  echo "=== parallel part: exit $$par; serial part: exit $$ser"; \
	  [ $$par = 0 ] && [ $$ser = 0 ]

# Any torch / Python pair, in .venv-torch$(TORCH)-py$(PYTHON): the core suite (everything but the framework
# integrations, which pin their own torch-dependent stacks). PYTHON is a version such as 3.13, found on PATH or
# under pyenv. Torch releases other than those on this machine's disk come from the registry as CUDA builds
# (2.15.0: about 5 GB, 2 minutes); they run on the CPU.
TORCH ?= 2.15.0
PYTHON ?= 3.13
TVENV := .venv-torch$(TORCH)-py$(PYTHON)
# The venv and torch alone first (.torch: the big download, which CI runs while corner A tests), then the package.
$(TVENV)/.torch:
	@pybin=; for c in $$(command -v python$(PYTHON)) $$(ls -d $$HOME/.pyenv/versions/$(PYTHON).*/bin/python$(PYTHON) 2>/dev/null); do \
	  [ -z "$$pybin" ] && "$$c" -c "" 2>/dev/null && pybin=$$c; done; \
	  [ -n "$$pybin" ] || { echo "no working python$(PYTHON) on PATH or under ~/.pyenv/versions"; exit 2; }; \
	  echo "building $(TVENV) with $$pybin"; rm -rf $(TVENV) && $$pybin -m venv $(TVENV)
	$(TVENV)/bin/python -m pip install --quiet --upgrade pip
	$(TVENV)/bin/python -m pip install --quiet "torch==$(TORCH)"
	$(TVENV)/bin/python -c "import torch; assert torch.__version__.split('+')[0] == '$(TORCH)', torch.__version__"
	touch $@

$(TVENV)/.ready: $(TVENV)/.torch pyproject.toml
	$(TVENV)/bin/python -m pip install --quiet -e ".[test,html]"
	$(TVENV)/bin/python -c "import torch; assert torch.__version__.split('+')[0] == '$(TORCH)', torch.__version__"
	touch $@

# TESTS narrows what runs (CI's corner B: the version-dependent tests, listed in .ci/run).
TESTS ?= --ignore=tests/integrations
# The serial part may be empty for a narrowed TESTS (pytest's exit code 5); the parallel part may not.
test-torch: $(TVENV)/.ready browser
	$(TVENV)/bin/python -c "import sys, torch; print('torch', torch.__version__, 'python', sys.version.split()[0])"
	$(TVENV)/bin/python -m compileall -q src tests
	@$(TVENV)/bin/python -m pytest -q -n $(WORKERS) -m "not serial" $(TESTS); par=$$?; \
	  $(TVENV)/bin/python -m pytest -q -m serial $(TESTS); ser=$$?; [ $$ser = 5 ] && ser=0; \
	  echo "=== parallel part: exit $$par; serial part: exit $$ser"; \
	  [ $$par = 0 ] && [ $$ser = 0 ]

# The integrations on the last transformers 4.x release (4.57.6), which has no ddp_static_graph field.
HF4VENV := .venv-hf4
$(HF4VENV)/.ready: pyproject.toml constraints.txt
	$(BASE_PYTHON) -m venv $(HF4VENV)
	$(HF4VENV)/bin/python -m pip install --quiet --upgrade pip
	grep -v '^transformers' constraints.txt > $(HF4VENV)/constraints.txt
	$(HF4VENV)/bin/python -m pip install --quiet -c $(HF4VENV)/constraints.txt -e ".[test,html,accelerate,lightning]" \
	  "transformers==4.57.6"
	touch $@

test-transformers4: $(HF4VENV)/.ready
	$(HF4VENV)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	$(HF4VENV)/bin/python -m pytest -q tests/integrations

bench: $(BIN)/ddp-doctor
	$(BIN)/python -m benchmarks

# The tests that start processes, RUNS times beside busy loops on every core: failures per test (tests/flakiness.py).
RUNS ?= 3
flaky: $(BIN)/ddp-doctor browser
	$(BIN)/python tests/flakiness.py --runs $(RUNS)
