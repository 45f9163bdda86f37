# The two commands: `make demo` (the main job) and `make test` (the whole suite). Both build .venv when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/ddp-doctor: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $@

.PHONY: demo test bench browser
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
demo: $(BIN)/ddp-doctor
	$(BIN)/ddp-doctor demo

# The bench --html test renders the page in headless Chromium (Debian's package).
browser:
	@command -v chromium >/dev/null || { echo "installing Debian's chromium for the HTML test"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium >/dev/null; }

test: $(BIN)/ddp-doctor browser
	$(BIN)/python -m pytest -q

bench: $(BIN)/ddp-doctor
	$(BIN)/python -m benchmarks
