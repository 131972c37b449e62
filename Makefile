# Two commands set up everything on a fresh machine:
#   make run    - virtual environment, PyTorch 2.13.0, gemmaspec; then a demo generation with the default model
#   make test   - the same setup, then the test suite (what .ci/run runs)
# PyTorch: TORCH=auto (default) installs the CUDA build when nvidia-smi sees a GPU, else the CPU build
# (from PyTorch's CPU wheel index; when that index is unreachable, a plain `pip install torch`).
# Force one with `make TORCH=cpu` or `make TORCH=cuda`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= auto
TORCH_VERSION   := 2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# make run's demo: a JSON list to continue. The base model writes more records in the same shape, and
# n-gram speculation drafts the keys and punctuation it has already seen (the acceptance line shows it).
define DEMO_PROMPT
{"users": [
  {"id": 1, "name": "Alice", "email": "alice@example.com", "role": "admin"},
  {"id": 2, "name": "Bob", "email": "bob@example.com", "role": "user"},

endef
PROMPT ?= $(DEMO_PROMPT)
export PROMPT
SPEC   ?=
TEMP   ?= 0
ARGS   ?= -n 128

.PHONY: setup run test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@torch="$(TORCH)"; \
	if [ "$$torch" = auto ]; then \
	    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then torch=cuda; else torch=cpu; fi; \
	fi; \
	case "$$torch" in \
	cuda) echo "PyTorch $(TORCH_VERSION): the CUDA build"; \
	      $(PY) -m pip install -q torch==$(TORCH_VERSION) ;; \
	cpu)  if $(PY) -c "import urllib.request; urllib.request.urlopen('$(TORCH_CPU_INDEX)/', timeout=5)" 2>/dev/null; then \
	          echo "PyTorch $(TORCH_VERSION): the CPU build, from $(TORCH_CPU_INDEX)"; \
	          $(PY) -m pip install -q --index-url $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION); \
	      else \
	          echo "PyTorch $(TORCH_VERSION): $(TORCH_CPU_INDEX) is unreachable: pip install torch from your configured index (on PyPI, Linux wheels are the CUDA build)"; \
	          $(PY) -m pip install -q torch==$(TORCH_VERSION); \
	      fi ;; \
	*)    echo "TORCH must be auto, cpu or cuda (got $$torch)" >&2; exit 2 ;; \
	esac
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m compileall -q src/gemmaspec >/dev/null  # bytecode now: the first start need not compile (~0.1 s)
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/gemmaspec generate -p "$$PROMPT" $(SPEC) --temp $(TEMP) $(ARGS)

test: setup
	$(PY) -m pytest -q --durations=15

bench: setup
	$(PY) benchmarks/decode.py

clean:
	rm -rf $(VENV) build src/*.egg-info
