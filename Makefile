# The two commands: `make demo` (the main job) and `make test` (the whole suite). Both build .venv when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/ddp-doctor: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $@

.PHONY: demo test bench
demo: $(BIN)/ddp-doctor
	$(BIN)/ddp-doctor demo

test: $(BIN)/ddp-doctor
	$(BIN)/python -m pytest -q

bench: $(BIN)/ddp-doctor
	$(BIN)/python -m benchmarks
