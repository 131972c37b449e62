"""Loading a GGUF straight from the mapped file: weights view the file's bytes (no conversion step,
no prepared copy), only the tokenizer is cached, and the default model costs about its file size in
memory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from gemmaspec import kernels
from gemmaspec.kernels import STORED_TYPES, StoredWeight
from gemmaspec.kernels.ggml_blocks import to_int8_blocks
from gemmaspec.loading.gguf import load_gguf, tensor_weight
from gemmaspec.loading.gguf_header import read_header

TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\u2581"] + \
    [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u2581" + chr(c) for c in range(ord("a"), ord("z") + 1)]
# the matrix types of the tiny model: kept as stored (Q4_0, Q8_0, Q5_0) or converted (Q4_1, Q5_1, F16)
TYPES = {"attn_q": T.Q4_0, "attn_k": T.Q8_0, "attn_v": T.Q5_0, "attn_output": T.Q4_1, "ffn_gate": T.Q5_1,
         "ffn_up": T.Q4_0, "ffn_down": T.F16, "token_embd": T.Q8_0}


def _tiny_gguf(path: Path, vocab_extra: int = 0) -> Path:
    """A complete tiny Gemma 3 GGUF (config metadata, a small SentencePiece-style vocabulary, random
    weights of the :data:`TYPES` types, F32 norms)."""
    from gemmaspec.models.config import Gemma3Config
    from gemmaspec.models.gemma3 import required_tensors

    tokens = TOKENS + [f"x{i}" for i in range(vocab_extra)]
    cfg = Gemma3Config(vocab_size=len(tokens), hidden_size=64, num_layers=2, intermediate_size=96, num_heads=2,
                       num_kv_heads=1, head_dim=32, sliding_window=8, sliding_window_pattern=2,
                       query_pre_attn_scalar=32.0)
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"token_embd": (cfg.vocab_size, h), "attn_q": (cfg.num_heads * hd, h), "attn_k": (hd, h),
              "attn_v": (hd, h), "attn_output": (h, cfg.num_heads * hd), "ffn_gate": (inter, h),
              "ffn_up": (inter, h), "ffn_down": (h, inter), "attn_q_norm": (hd,), "attn_k_norm": (hd,)}
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, v in (("embedding_length", h), ("block_count", cfg.num_layers), ("feed_forward_length", inter),
                   ("attention.head_count", cfg.num_heads), ("attention.head_count_kv", cfg.num_kv_heads),
                   ("attention.key_length", hd), ("attention.value_length", hd), ("attention.sliding_window", 8)):
        w.add_uint32(f"gemma3.{key}", v)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 7 + [-float(i) for i in range(len(tokens) - 7)])
    w.add_token_types([3, 3, 3, 2, 3, 3] + [1] * (len(tokens) - 6))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    rng = np.random.default_rng(3)
    for name in required_tensors(cfg):
        base = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        shape = shapes.get(base, (h,))
        if len(shape) == 1:
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        v = (rng.standard_normal(shape) / shape[1] ** 0.5).astype(np.float32)
        qtype = TYPES[base]
        if qtype == T.F16:
            w.add_tensor(name, v.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(v, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges where this process maps ``path`` (/proc/self/maps)."""
    out, target = [], str(Path(path).resolve())
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == target:
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out.append((a, b))
    return out


@pytest.fixture()
def home(tmp_path, monkeypatch):
    """An empty cache home for this test."""
    d = tmp_path / "home"
    monkeypatch.setenv("GEMMASPEC_HOME", str(d))
    return d


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_weights_view_the_mapped_file(tmp_path, home):
    path = _tiny_gguf(tmp_path / "tiny.gguf")
    loaded = load_gguf(path, use_cache=False)
    ranges = _mapped_ranges(path)
    assert ranges, "the file is not mapped"

    def in_file(ptr):
        return any(a <= ptr < b for a, b in ranges)

    header = read_header(path)
    ref = gguf.GGUFReader(path)
    kept = converted = 0
    for t, r in zip(header.tensors, ref.tensors):
        w = loaded.model.weights[t.name]
        data = np.asarray(r.data)
        if t.tensor_type.name in STORED_TYPES:
            assert isinstance(w, StoredWeight) and w.qtype == t.tensor_type.name, t.name
            assert in_file(w.raw.data_ptr()) and w.raw.shape == (t.shape[0], t.n_bytes // t.shape[0])
            assert np.array_equal(w.raw.numpy().reshape(-1), data.reshape(-1))  # the file's bytes, no copy
            kept += 1
        elif t.tensor_type == T.F32:
            assert isinstance(w, torch.Tensor) and w.dtype == torch.float32 and in_file(w.data_ptr())
            assert np.array_equal(w.numpy(), data)
        elif t.tensor_type == T.F16:
            assert w.dtype == torch.float32 and not in_file(w.data_ptr())
            assert np.array_equal(w.numpy(), data.astype(np.float32))
        else:  # Q4_1, Q5_1: the exact int8 form, built from a read (not a view) of the file
            assert isinstance(w, kernels.QuantizedWeight) and not in_file(w.q.data_ptr())
            q, s, _, g = to_int8_blocks(data, t.tensor_type, *t.shape)
            assert np.array_equal(w.q.numpy(), q) and np.array_equal(w.scale.numpy(), s) and g == w.group
            converted += 1
    assert kept == 9 and converted == 4  # Q4_0, Q8_0, Q5_0 kept as stored; Q4_1, Q5_1 converted
    assert loaded.tokenizer is not None and loaded.tokenizer.encode("ab", add_bos=True)[0] == 2


def test_writing_a_weight_never_changes_the_file(tmp_path, home):
    path = _tiny_gguf(tmp_path / "tiny.gguf")
    before = path.read_bytes()
    header = read_header(path)
    norm = tensor_weight(header, header.tensor("output_norm.weight"))
    norm.add_(1.0)  # copy-on-write: this process's page only
    q = tensor_weight(header, header.tensor("blk.0.attn_q.weight"))
    q.raw.zero_()
    assert path.read_bytes() == before
    fresh = read_header(path)  # a new map of the file sees the old values; this process keeps its own
    assert torch.equal(tensor_weight(fresh, fresh.tensor("output_norm.weight")) + 1.0, norm)
    assert tensor_weight(fresh, fresh.tensor("blk.0.attn_q.weight")).raw.any() and not q.raw.any()


def test_mapped_model_computes_what_converted_weights_do(tmp_path, home):
    """The logits of the model built from the mapped file equal those of one built from
    gguf.GGUFReader's data converted to the int8 form (the previous loader's path), bit for bit."""
    from gemmaspec.models.gemma3 import Gemma3Model

    path = _tiny_gguf(tmp_path / "tiny.gguf")
    loaded = load_gguf(path, use_cache=False)
    weights = {}
    for t in gguf.GGUFReader(path).tensors:
        shape = [int(x) for x in reversed(t.shape.tolist())]
        if t.tensor_type in (T.F32, T.F16):
            weights[t.name] = torch.from_numpy(np.array(t.data, dtype=np.float32)).reshape(shape)
        else:
            q, s, o, g = to_int8_blocks(np.asarray(t.data), t.tensor_type, *shape)
            weights[t.name] = kernels.QuantizedWeight(torch.from_numpy(q), torch.from_numpy(s),
                                                      None if o is None else torch.from_numpy(o), g)
    ref = Gemma3Model(loaded.config, weights)
    tokens = torch.arange(20) * 7 % loaded.config.vocab_size

    def logits(model):  # a prefill of more rows than the small-product kernel takes, then decode steps
        cache = model.new_cache(64)
        out = [model.forward(tokens, cache, all_logits=True).logits]
        for tok in (5, 9, 11):
            out.append(model.forward(torch.tensor([tok]), cache).logits)
        return torch.cat(out)

    got, want = logits(loaded.model), logits(ref)
    assert torch.isfinite(want).all()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_only_the_tokenizer_is_cached(tmp_path, home, capfd):
    path = _tiny_gguf(tmp_path / "tiny.gguf")
    first = load_gguf(path)
    err = capfd.readouterr().err
    lines = [x for x in err.strip().splitlines() if "no fast tokenizer" not in x]  # a tiny vocabulary has none
    assert err.count("building the tokenizer") == 1 and len(lines) == 1, err
    tree = _tree(home)
    entries = list((home / "tokenizers").iterdir())
    assert len(entries) == 1 and {p.name for p in entries[0].iterdir()} >= {"tokenizer.json", "tokenizer_meta.json"}
    assert all(k.startswith("tokenizers") for k in tree), tree  # nothing but the tokenizer

    again = load_gguf(path)
    assert capfd.readouterr().err == "" and _tree(home) == tree  # a second load writes nothing
    text = "abc xyz<end_of_turn>"
    assert again.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert again.tokenizer.stop_ids == first.tokenizer.stop_ids and again.tokenizer.chat_template == first.tokenizer.chat_template

    # the key is the vocabulary, not the path: a copy elsewhere hits the same entry
    copy = tmp_path / "elsewhere" / "copy.gguf"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    load_gguf(copy)
    assert capfd.readouterr().err == "" and _tree(home) == tree
    # a different vocabulary gets its own entry
    load_gguf(_tiny_gguf(tmp_path / "other.gguf", vocab_extra=5))
    assert "building the tokenizer" in capfd.readouterr().err
    assert len(list((home / "tokenizers").iterdir())) == 2


def test_a_damaged_entry_is_rebuilt(tmp_path, home, capfd):
    path = _tiny_gguf(tmp_path / "tiny.gguf")
    want = load_gguf(path).tokenizer.encode("abc def")
    (entry,) = (home / "tokenizers").iterdir()
    (entry / "tokenizer.json").write_text('{"truncated": ')
    capfd.readouterr()
    got = load_gguf(path).tokenizer.encode("abc def")
    err = capfd.readouterr().err
    assert "does not load" in err and "building the tokenizer" in err
    assert got == want
    json.loads((entry / "tokenizer.json").read_text())  # whole again
    (entry / "tokenizer_meta.json").unlink()
    assert load_gguf(path).tokenizer.encode("abc def") == want


def test_an_unusable_cache_home_still_loads(tmp_path, monkeypatch, capfd):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("GEMMASPEC_HOME", str(blocker / "home"))  # cannot be created
    loaded = load_gguf(_tiny_gguf(tmp_path / "tiny.gguf"))
    assert loaded.tokenizer.encode("abc", add_bos=False)
    assert "no tokenizer cache" in capfd.readouterr().err


def test_without_cache_and_for_an_assistant_nothing_is_written(tmp_path, home):
    from test_gemma4_gguf import _SmallBPE, _with_tokenizer
    from tiny_gemma4 import tiny_assistant

    from gemmaspec.loading.convert import convert

    load_gguf(_tiny_gguf(tmp_path / "tiny.gguf"), use_cache=False)
    tiny_assistant().save_pretrained(tmp_path / "a")
    _with_tokenizer(tmp_path / "a", _SmallBPE())
    convert(tmp_path / "a", tmp_path / "a.gguf", "q8_0")
    loaded = load_gguf(tmp_path / "a.gguf")
    assert loaded.arch.role == "assistant" and loaded.tokenizer is None
    assert not home.exists() or _tree(home) == {}


_MEASURE = """
import json, os, sys, time
import logging
import torch
from gemmaspec.kernels import load_library
from gemmaspec.loading import load_checkpoint

logging.basicConfig(level=logging.INFO, format="%(message)s")  # the library's notes, as a program shows them

def rss():
    try:
        import psutil
        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

load_library()  # the kernel is part of the runtime (compiled on a first start)
before = rss()
t = time.perf_counter()
loaded = load_checkpoint(sys.argv[1], role="target")
seconds = time.perf_counter() - t
print(json.dumps({"before": before, "after": rss(), "seconds": seconds}))
"""


def test_default_model_memory_and_second_load(model_path, tmp_path):
    """In fresh processes (with a cache home holding only the compiled kernels, copied from this
    session's build to spare the CI a minute of compiling): the first load builds the tokenizer; the
    second writes nothing, and adds less than 1.2x the file size to the process's RSS."""
    import shutil

    from gemmaspec import kernels
    from gemmaspec.paths import cache_home

    home = tmp_path / "home"
    kernels.load_library()  # built (or found) in this session's cache home
    if (cache_home() / "kernels").is_dir():
        shutil.copytree(cache_home() / "kernels", home / "kernels")
    env = dict(os.environ, GEMMASPEC_HOME=str(home), PYTHONPATH=os.pathsep.join(sys.path))

    def run():
        res = subprocess.run([sys.executable, "-c", _MEASURE, str(model_path)], check=False, env=env, capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr

    _, err = run()
    assert "building the tokenizer" in err
    tree = _tree(home)
    assert any(k.startswith("tokenizers/") for k in tree) and not any(k.startswith("prepared") for k in tree)
    second, err = run()
    assert "building the tokenizer" not in err
    assert _tree(home) == tree, "the second load wrote to the cache"
    added = second["after"] - second["before"]
    size = model_path.stat().st_size
    print(f"default model: RSS +{added / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file, load {second['seconds']:.2f} s")
    assert added < 1.2 * size, (added / 2**20, size / 2**20)
