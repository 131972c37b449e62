"""`gemmaspec fit`: the estimate against measured memory, the KV arithmetic, refusals with numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_gemma4 import TARGET

from gemmaspec import cli
from gemmaspec.manage import fit
from gemmaspec.models.config import Gemma4Config

ROOT = Path(__file__).resolve().parents[1]


def test_estimate_agrees_with_measured_memory_on_the_default_model():
    """A fresh process fills a 512-token context; fit's estimate is at most 10% below its peak resident
    memory (under would say a model fits that does not) and at most 20% above it. How much the prefill's
    BLAS calls keep resident depends on the CPU: -2% on a 2-core Intel Xeon, +14% on a 2-core AMD
    EPYC (Zen 4), the same code and libraries."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "fit_check.py", "--child", "-", "-", "512"], cwd=ROOT / "benchmarks",
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["tokens"] > 0
    assert -0.10 < r["estimate"] / r["peak"] - 1 < 0.20, r


def test_kv_caps_sliding_layers_and_counts_shared_layers_once():
    c = Gemma4Config.from_hf(TARGET)
    m = fit.ModelInfo(Path("x"), "target", "tiny", c, (), True)
    ctx = 400
    own = [i for i in range(c.num_layers) if c.kv_source()[i] == i]
    assert len(own) == c.num_layers - c.num_kv_shared_layers
    want = 0
    for i in own:
        rows = c.sliding_window + fit.MAX_ROLLBACK if c.layer_types[i] == "sliding" else ctx
        want += 2 * rows * c.layer_kv_heads(i) * c.layer_head_dim(i) * 4
    assert fit.kv_bytes_per_slot(m, ctx) == want
    est = fit.estimate(m, None, ctx, slots=3, device="cuda")
    assert est.kv == 3 * want


@pytest.mark.parametrize("text,want", [("8GiB", 8 << 30), ("8G", 8 << 30), ("8GB", 8 * 10**9), ("512M", 512 << 20),
                                       ("1.5GiB", 3 << 29), ("1000", 1000)])
def test_parse_mem(text, want):
    assert fit.parse_mem(text) == want


def test_fit_reports_a_setup_too_big_for_the_device(capsys):
    assert cli.main(["fit", "--device", "300M"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "300.0 MiB" in out and "target weights" in out


def test_generate_refuses_with_the_numbers_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(fit, "free_memory", lambda device: 700 << 20)
    loaded = []
    import gemmaspec.loading.engine as loader

    monkeypatch.setattr(loader, "load_engine", lambda *a, **k: loaded.append(1))
    assert cli.main(["generate", "-p", "hi", "-n", "1", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit" in err[0] and "700.0 MiB free" in err[0] and "target " in err[0]
    assert "use -c" in err[0] and not loaded  # a smaller context fits; nothing was loaded
