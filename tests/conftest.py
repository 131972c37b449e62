"""Shared fixtures. The real model is Gemma 3 270M from the installed default-model package."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def _machine() -> str:
    """The machine, for the run's summary (results that depend on it, e.g. draft lengths chosen from
    timings, can then be read against it): CPU model, CPUs this process may use, the kernel's path."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    from gemmaspec.kernels import kernel_isa
    from gemmaspec.loading.engine import physical_cores

    return (f"machine: {model}; {len(os.sched_getaffinity(0))} CPUs usable, {physical_cores()} physical cores; "
            f"kernel path {kernel_isa()}; torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})")


def pytest_terminal_summary(terminalreporter):
    """Name the machine at the end of every run (``-q`` hides the header): a failure that depends on the
    CPU or its timing can be read against it."""
    terminalreporter.write_line(_machine())


@pytest.fixture(scope="session", autouse=True)
def library_notes_on_stderr():
    """The library's notes (tokenizer cache, kernel compile) on stderr, as the ``gemmaspec`` command
    shows them, for tests that call the library in this process."""
    from gemmaspec.cli.args import setup_logging

    setup_logging()


@pytest.fixture(autouse=True)
def activation_mode_restored():
    """Each test leaves the kernels' activation mode (``--act-quant``) as it found it: a test that sets
    one would otherwise change how the session's engine computes in every test after it (under
    ``auto`` the default model's head multiplies int8 activations, a server subprocess's too)."""
    from gemmaspec.kernels import build

    saved = build._act_mode, build._act_q8
    yield
    build._act_mode, build._act_q8 = saved


@pytest.fixture(scope="session")
def model_path():
    from gemmaspec.manage.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def engine(model_path):
    from gemmaspec.loading.engine import load_engine

    return load_engine(model_path, ctx_size=2048, device="cpu")


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture(scope="session")
def reference(model_path):
    """transformers' Gemma3ForCausalLM and tokenizer loaded from the same GGUF, float32.

    transformers parses the file with ``gguf.GGUFReader`` three times (tokenizer, config, tensors),
    ~18 s each for the 262,144-entry vocabulary's metadata; the reader is read-only, so the three loads
    share one parse (the same reader and code path, parsed once)."""
    from unittest import mock

    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parsed = {}
    real = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = real(path, *args, **kwargs)
        return parsed[key]

    d, f = str(model_path.parent), model_path.name
    with mock.patch.object(gguf, "GGUFReader", reader):
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    assert len(parsed) == 1  # the three loads shared one parse
    model.eval()
    return model, tok


def run_cli(*args, stdin=None, env=None, timeout=300):
    """Run ``python -m gemmaspec ARGS``; returns CompletedProcess with text stdout/stderr."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "gemmaspec", *args], input=stdin, capture_output=True,
                          text=True, env=e, timeout=timeout)


class ServerProcess:
    """A ``gemmaspec serve`` subprocess on a free port (``--port 0``); its stderr goes to ``log_path``.

    Attributes: ``url`` (``http://127.0.0.1:PORT``), ``health_codes`` (every /health status seen
    while waiting for it to load), ``proc``.
    """

    def __init__(self, tmp_dir, *args, timeout=180):
        import re
        import time

        import httpx

        self.log_path = tmp_dir / "serve.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "gemmaspec", "serve", "--port", "0", *args],
                                     stdout=subprocess.DEVNULL, stderr=self._log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        port = None
        while port is None:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.log_path.read_text())
            if m:
                port = int(m.group(1))
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"gemmaspec serve did not start: {self.log_path.read_text()}")
            else:
                time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"
        self.health_codes = []
        while True:
            try:
                code = httpx.get(self.url + "/health", timeout=5).status_code
                self.health_codes.append(code)
                if code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"gemmaspec serve did not become healthy: {self.log_path.read_text()}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text()

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The default server: embedded model, the default speculation (ngram-simple,draft-mtp, n_max 8 as the bound of the length chosen per round), 4 slots."""
    s = ServerProcess(tmp_path_factory.mktemp("serve"), "-np", "4", "-c", "2048")
    yield s
    s.close()


@pytest.fixture(scope="module")
def lib():
    """The compiled C kernel library; tests that need it skip where it cannot be built."""
    from gemmaspec import kernels

    lib = kernels.load_library()
    if lib is None:
        pytest.skip("no C compiler: kernels fall back to torch")
    return lib
