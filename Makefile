# Two commands set up everything on a fresh machine:
#   make run    - virtual environment, PyTorch 2.13.0, gemmaspec (the runtime only); then the demo: the
#                 default model decodes a prompt plainly and with speculation, and says how much faster
#                 and whether the two texts are identical
#   make test   - the same setup plus the test extra (pytest, scipy, playwright...), then the test suite in
#                 TEST_WORKERS=2 processes (what .ci/run runs)
# Each phase says what it does and about how long it takes; pip shows its own progress.
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
# --compare: the same prompt plainly, then with speculation (DEMO= for one run of what SPEC says)
DEMO   ?= --compare
# make test: pytest-xdist worker processes (2: half the suite's time is process starts, servers and
# waits, which overlap; more would multiply the models held in memory, ~1-5 GB a worker)
TEST_WORKERS ?= 2

.PHONY: setup run test bench clean

RUNTIME := $(VENV)/.runtime-installed
TESTDEPS := $(VENV)/.test-installed

$(RUNTIME): pyproject.toml
	@echo "==> [1/4] virtual environment in $(VENV), pip upgraded (under a minute)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	@torch="$(TORCH)"; \
	if [ "$$torch" = auto ]; then \
	    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then torch=cuda; else torch=cpu; fi; \
	fi; \
	case "$$torch" in \
	cuda) echo "==> [2/4] PyTorch $(TORCH_VERSION), the CUDA build (about 3 GB with its nvidia-* packages; 3-15 minutes)"; \
	      $(PY) -m pip install torch==$(TORCH_VERSION) ;; \
	cpu)  if $(PY) -c "import urllib.request; urllib.request.urlopen('$(TORCH_CPU_INDEX)/', timeout=5)" 2>/dev/null; then \
	          echo "==> [2/4] PyTorch $(TORCH_VERSION), the CPU build from $(TORCH_CPU_INDEX) (a ~190 MB download; 1-5 minutes)"; \
	          $(PY) -m pip install --index-url $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION); \
	      else \
	          echo "==> [2/4] PyTorch $(TORCH_VERSION): $(TORCH_CPU_INDEX) is unreachable: pip install torch from your configured index (on PyPI, Linux wheels are the CUDA build: about 3 GB; 3-15 minutes)"; \
	          $(PY) -m pip install torch==$(TORCH_VERSION); \
	      fi ;; \
	*)    echo "TORCH must be auto, cpu or cuda (got $$torch)" >&2; exit 2 ;; \
	esac
	@echo "==> [3/4] gemmaspec and its libraries (about 350 MB to download, 245 MB of it the default model's package; 1-5 minutes)"
	$(PY) -m pip install -e .
	$(PY) -m compileall -q src/gemmaspec >/dev/null  # bytecode now: the first start need not compile (~0.1 s)
	@echo "==> [4/4] compiling the C kernel for this CPU (once per machine: $$($(PY) -c 'from gemmaspec.kernels.build import COMPILE_TIME; print(COMPILE_TIME)'))"
	$(PY) -c "from gemmaspec.kernels import load_library; load_library()"
	touch $@

$(TESTDEPS): $(RUNTIME)
	@echo "==> the test extra: pytest, pytest-xdist, hypothesis, scipy, accelerate, openai, httpx, playwright (about 100 MB to download; 1-3 minutes)"
	$(PY) -m pip install -e '.[test]'
	touch $@

setup: $(RUNTIME)

run: setup
	@echo "==> the demo: the default model continues a JSON list plainly, then with speculation (seconds; a first start also assembles the model and builds its tokenizer: up to a minute)"
	$(VENV)/bin/gemmaspec generate -p "$$PROMPT" $(SPEC) --temp $(TEMP) $(ARGS) $(DEMO)

test: $(TESTDEPS)
	@echo "==> the test suite in $(TEST_WORKERS) worker processes, a file per worker at a time (about 12 minutes on 2 cores)"
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

bench: setup
	$(PY) benchmarks/decode.py

clean:
	rm -rf $(VENV) build src/*.egg-info
