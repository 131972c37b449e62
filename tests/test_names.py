"""Catalog names before any download: ``gemmaspec fit -m NAME`` and ``gemmaspec export … -m NAME`` read
what the hub serves without the weights (a GGUF's header by range, config.json and the safetensors
headers) from a local fake hub (tests/fake_hub.py) behind HF_ENDPOINT; no internet, nothing cached."""

import re
import shlex

import pytest
import torch
from fake_hub import serve_fake_hub
from tiny_gemma4 import TARGET, randomize, tiny_assistant

from gemmaspec import cli
from gemmaspec.manage import catalog, hub

REPO = "google/gemma-4-E4B-it-qat-q4_0-unquantized"
GGUF_REPO = "google/gemma-4-E4B-it-qat-q4_0-gguf"
GGUF_FILE = "gemma-4-E4B-it-qat-q4_0.gguf"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_gemma4_gguf import _SmallBPE, _with_tokenizer
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from gemmaspec.loading.convert import convert

    root = tmp_path_factory.mktemp("names")
    randomize(Gemma4ForCausalLM(Gemma4TextConfig(**TARGET)).eval(), 1).to(torch.bfloat16).save_pretrained(root / "t")
    tiny_assistant().to(torch.bfloat16).save_pretrained(root / "a")
    _with_tokenizer(root / "t", _SmallBPE())
    convert(root / "t", root / "t.gguf", "q8_0")
    return root / "t", root / "a", root / "t.gguf"


@pytest.fixture
def fake(tiny, tmp_path, monkeypatch):
    t, a, g = tiny
    h = serve_fake_hub(monkeypatch, tmp_path)
    h.add(REPO, {p.name: p.read_bytes() for p in t.iterdir() if p.is_file()})
    h.add(REPO + "-assistant", {p.name: p.read_bytes() for p in a.iterdir() if p.is_file()})
    h.add(GGUF_REPO, {GGUF_FILE: g.read_bytes(), "mmproj-x.gguf": b"x"})
    yield h
    h.close()


def _no_weights_fetched(h):
    """Every request for weights asked for a byte range well short of the file."""
    for method, path, rng in h.requests:
        if method == "GET" and path.endswith((".safetensors", ".gguf")):
            assert rng, path
            a, b = map(int, re.match(r"bytes=(\d+)-(\d+)", rng).groups())
            assert b - a < 8 << 20, rng


def _fit(capsys, *argv):
    code = cli.main(["fit", "--device", "8GiB", *argv])
    out = capsys.readouterr()
    return code, out.out


def test_fit_by_name_before_download_matches_the_downloaded_files(fake, capsys, tiny):
    """``fit -m gemma-4-e4b-it-qat`` (the docs' example) answers from the hub's metadata: the same table as
    for the files themselves, no weights fetched, nothing put in the hub cache (it said "not downloaded")."""
    t, a, g = tiny
    for name, local, md in (("gemma-4-e4b-it-qat", t, ["-md", "gemma-4-e4b-it-qat-assistant"]),
                            ("gemma-4-e4b-it-qat-gguf", g, [])):
        local_md = ["-md", str(a)] if md else []
        code, remote = _fit(capsys, "-m", name, *md, "-c", "256")
        assert code == 0, remote
        table = remote.splitlines()[:-1]  # the last line is the drafting plan (the name brings its n-max)
        assert table == _fit(capsys, "-m", str(local), *local_md, "-c", "256")[1].splitlines()[:-1]
        assert "target weights" in remote and "fits" in remote
    _no_weights_fetched(fake)
    assert hub.cached_path(catalog.get("gemma-4-e4b-it-qat")) is None
    assert hub.cached_path(catalog.get("gemma-4-e4b-it-qat-gguf")) is None


def test_export_by_name_before_download(fake, capsys, tiny):
    """``export vllm -m NAME``: the hub ids, -c and the tensor-parallel size from the hub's metadata;
    ``export llama-server -m NAME``: the file llama-server fetches itself (--hf-repo / --hf-file), with
    the model's -c; a checkpoint name is refused for llama-server naming its GGUF."""
    t, a, g = tiny
    assert cli.main(["export", "vllm", "-m", "gemma-4-e4b-it-qat", "-md", "gemma-4-e4b-it-qat-assistant",
                     "--spec-draft-n-max", "4", "-c", "0"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv[:3] == ["vllm", "serve", REPO]
    assert argv[argv.index("--max-model-len") + 1] == str(TARGET["max_position_embeddings"])
    assert f'"model": "{REPO}-assistant"' in argv[argv.index("--speculative-config") + 1]
    assert cli.main(["export", "llama-server", "-m", "gemma-4-e4b-it-qat-gguf", "-np", "2", "-c", "64"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert "-m" not in argv
    assert argv[argv.index("--hf-repo") + 1] == GGUF_REPO and argv[argv.index("--hf-file") + 1] == GGUF_FILE
    assert argv[argv.index("-c") + 1] == "128"
    local = shlex.split(_export(capsys, "llama-server", "-m", str(g), "-np", "2", "-c", "64"))
    assert local[local.index("-c"):] == argv[argv.index("-c"):]  # the same settings as for the file itself
    assert cli.main(["export", "llama-server", "-m", "gemma-4-e4b-it-qat"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gemma-4-e4b-it-qat-gguf" in err[0], err
    _no_weights_fetched(fake)
    assert cli.main(["export", "llama-server", "-m", str(g.parent / "missing.gguf")]) == 1  # a file is still checked
    out = capsys.readouterr()
    assert out.out == "" and "missing.gguf" in out.err


def _export(capsys, *argv):
    assert cli.main(["export", *argv]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name,fail", [("gemma-4-e4b-it-qat", r"config\.json"),
                                       ("gemma-4-e4b-it-qat", r"\.safetensors"),
                                       ("gemma-4-e4b-it-qat-gguf", r"/api/models/"),  # the repo listing
                                       ("gemma-4-e4b-it-qat-gguf", r"\.gguf")])
def test_fit_by_name_without_network_is_one_error_line(fake, capsys, name, fail):
    """The hub dropping the connection at any read ``fit -m NAME`` makes: one ``error:`` line."""
    fake.fail.append(fail)
    assert cli.main(["fit", "-m", name, "--device", "8GiB"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "cannot reach the hub" in err[0], err


def test_fit_by_name_reads_every_shard_header(fake, capsys, tmp_path):
    """A sharded checkpoint (``model.safetensors.index.json``): every shard's header is read by range and
    the estimate is the one for the downloaded directory."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    d = tmp_path / "sharded"
    randomize(Gemma4ForCausalLM(Gemma4TextConfig(**TARGET)).eval(), 3).to(torch.bfloat16).save_pretrained(
        d, max_shard_size="300KB")
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(shards) > 1 and (d / "model.safetensors.index.json").exists()
    fake.add("google/gemma-4-12B-it-qat-q4_0-unquantized", {p.name: p.read_bytes() for p in d.iterdir()})
    code, remote = _fit(capsys, "-m", "gemma-4-12b-it-qat", "-c", "128")
    assert code == 0, remote
    assert remote.splitlines()[:-1] == _fit(capsys, "-m", str(d), "-c", "128")[1].splitlines()[:-1]
    got = {p.rsplit("/", 1)[1] for m, p, r in fake.requests if m == "GET" and p.endswith(".safetensors")}
    assert got == set(shards)
    _no_weights_fetched(fake)
