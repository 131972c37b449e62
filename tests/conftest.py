"""Shared fixtures. The real model is Gemma 3 270M from the installed default-model package."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


@pytest.fixture(scope="session")
def model_path():
    from gemmaspec.loading.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def engine(model_path):
    from gemmaspec.loader import load_engine

    return load_engine(model_path, ctx_size=2048, device="cpu")


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture(scope="session")
def reference(model_path):
    """transformers' Gemma3ForCausalLM and tokenizer loaded from the same GGUF, float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = str(model_path.parent), model_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    return model, tok


def run_cli(*args, stdin=None, env=None, timeout=300):
    """Run ``python -m gemmaspec ARGS``; returns CompletedProcess with text stdout/stderr."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "gemmaspec", *args], input=stdin, capture_output=True,
                          text=True, env=e, timeout=timeout)
