# Both entry points build .venv from nothing: torch's CPU wheel first, then the package.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export LMCACHE_TRACK_USAGE := false
export DO_NOT_TRACK := 1

.PHONY: venv demo test chaos bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/loadback demo

test: venv
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS)

chaos: venv
	$(BIN)/loadback chaos run --scenario all

bench: venv
	$(BIN)/loadback bench client
	$(BIN)/loadback bench core

clean:
	rm -rf $(VENV) build *.egg-info
