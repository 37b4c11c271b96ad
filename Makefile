# Two commands do all set-up on a fresh machine (Python 3.11 + pip): `make demo`, `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# the library and its programs (no torch)
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	touch $@

# + the test extra; torch first, pinned to the version the torch references were checked with
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(VENV)/.installed $@

demo: $(VENV)/.installed
	$(BIN)/python -m serve.generate

test: $(VENV)/.installed-test
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(BIN)/python -m pytest -q -n 2 tests

clean:
	rm -rf $(VENV)
