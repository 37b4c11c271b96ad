# Two commands do all set-up on a fresh machine (Python 3.11 + pip): `make demo`, `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned, so nothing later resolves a CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m serve.generate

test: $(STAMP)
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(BIN)/python -m pytest -q -n 2 tests

clean:
	rm -rf $(VENV)
