# Two commands set up everything on a fresh machine:
#   make run    - virtual environment, PyTorch 2.13.0 (CPU), gemmaspec; then generate with the default model
#   make test   - the same setup, then the test suite (what .ci/run runs)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROMPT ?= Write a short story about a robot who learns to paint.
ARGS   ?= -n 128 --spec-type ngram-simple

.PHONY: setup run test test-slow bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/gemmaspec generate -p "$(PROMPT)" $(ARGS)

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

bench: setup
	$(PY) benchmarks/decode.py

clean:
	rm -rf $(VENV) build src/*.egg-info
