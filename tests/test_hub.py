"""`gemmaspec pull` against a local fake hub (tests/fake_hub.py) behind HF_ENDPOINT: hashes, resume,
the catalog's QAT pairing, close matches for unknown names, offline mode. No internet."""

import hashlib
import os
import socket

import pytest
from fake_hub import serve_fake_hub

from gemmaspec import cli
from gemmaspec.errors import InputError, ModelFileError
from gemmaspec.manage import catalog, hub


@pytest.fixture
def fake(tmp_path, monkeypatch):
    h = serve_fake_hub(monkeypatch, tmp_path)
    yield h
    h.close()


def _files(root):
    return sorted(p for p in root.rglob("*") if p.is_file() and ".locks" not in p.parts and p.name != "CACHEDIR.TAG")


def test_pull_with_the_right_hash_is_cached(fake, tmp_path, monkeypatch):
    data = os.urandom(200_000)
    fake.add("acme/m", {"m.gguf": data})
    [got] = hub.pull("acme/m:m.gguf", sha256=hashlib.sha256(data).hexdigest())
    assert got.path.read_bytes() == data and got.sha256 == hashlib.sha256(data).hexdigest()
    n = len(fake.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # cached: found without asking the hub
    [again] = hub.pull("acme/m:m.gguf")
    assert again.path == got.path and len(fake.requests) == n


def test_wrong_hash_fails_and_leaves_nothing(fake, tmp_path):
    data = os.urandom(100_000)
    fake.add("acme/m", {"m.gguf": data})
    with pytest.raises(ModelFileError) as exc:
        hub.pull("acme/m:m.gguf", sha256="ab" * 32)
    msg = str(exc.value)
    assert "m.gguf" in msg and "ab" * 32 in msg and hashlib.sha256(data).hexdigest() in msg
    assert _files(tmp_path / "hf") == []


def test_catalog_hash_is_checked_whatever_the_repo(fake, tmp_path):
    name = "gemma-4-E2B-it-qat-assistant-q4_0-exact.gguf"
    fake.add("someone/drafters", {name: b"not the published drafter"})
    with pytest.raises(ModelFileError) as exc:
        hub.pull(f"someone/drafters:{name}")
    assert catalog.by_file(name).sha256 in str(exc.value)
    assert _files(tmp_path / "hf") == []


def test_interrupted_download_resumes(fake):
    data = os.urandom(12 << 20)  # more than huggingface_hub's 10 MiB read chunk, so bytes reach the disk first
    fake.add("acme/m", {"big.gguf": data})
    fake.cut["big.gguf"] = 11 << 20  # the first GET drops the connection after 11 MiB
    [got] = hub.pull("acme/m:big.gguf")
    ranges = [r for m, p, r in fake.requests if m == "GET" and p.endswith("big.gguf")]
    assert ranges[0] is None and any(r and int(r.split("=")[1].rstrip("-")) > 0 for r in ranges[1:]), ranges
    assert hashlib.sha256(got.path.read_bytes()).digest() == hashlib.sha256(data).digest()


def test_with_assistant_pairs_a_qat_target_with_the_qat_assistant(fake):
    files = lambda tag: {"config.json": f'{{"model_type": "x", "tag": "{tag}"}}'.encode(),  # noqa: E731
                         "model.safetensors": os.urandom(1000)}
    fake.add("google/gemma-4-E2B-it-qat-q4_0-unquantized", files("qat target"))
    fake.add("google/gemma-4-E2B-it-qat-q4_0-unquantized-assistant", files("qat assistant"))
    fake.add("google/gemma-4-E2B-it-assistant", files("bf16 assistant"))
    target, assistant = hub.pull("gemma-4-e2b-it-qat", with_assistant=True)
    assert assistant.label == "gemma-4-e2b-it-qat-assistant"
    assert "qat assistant" in (assistant.path / "config.json").read_text()
    assert not any("E2B-it-assistant" in p for _, p, _ in fake.requests)
    # the names now resolve to the cached directories, as -m/-md take them
    assert hub.resolve("gemma-4-e2b-it-qat")[0] == str(target.path)
    assert hub.resolve("GEMMA-4-E2B-IT-QAT-ASSISTANT")[0] == str(assistant.path)


def test_unknown_name_lists_close_matches(fake, capsys):
    assert cli.main(["pull", "gemma-4-e2b-qat"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "close matches: " in err and "gemma-4-e2b-it-qat" in err
    with pytest.raises(InputError, match="close matches"):
        hub.resolve("gemma4-e4b-it")


def test_not_downloaded_name_says_which_pull(fake):
    with pytest.raises(InputError, match="gemmaspec pull gemma-4-31b-it"):
        hub.resolve("gemma-4-31b-it")


def test_offline_answers_at_once_and_lists_the_cache(fake, monkeypatch):
    fake.add("acme/m", {"m.gguf": b"x" * 1000})
    hub.pull("acme/m:m.gguf")
    silent = socket.socket()  # a hub that accepts connections and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        with pytest.raises(ModelFileError) as exc:
            hub.pull("acme/other:x.gguf")
        msg = str(exc.value)
        assert "offline" in msg and "acme/m (m.gguf)" in msg
        with pytest.raises(ModelFileError, match="offline"):
            hub.pull("gemma-4-e4b-it-qat-gguf")
    finally:
        silent.close()


@pytest.fixture
def pinned_catalog(tmp_path, monkeypatch):
    """The catalog with one entry's sha256 replaced (the published files cannot be served here)."""
    import json

    def use(name, data):
        d = json.loads(catalog.CATALOG_FILE.read_text())
        next(m for m in d["models"] if m["name"] == name)["sha256"] = hashlib.sha256(data).hexdigest()
        f = tmp_path / "catalog.json"
        f.write_text(json.dumps(d))
        monkeypatch.setattr(catalog, "CATALOG_FILE", f)
        catalog._load.cache_clear()
    yield use
    catalog._load.cache_clear()


def test_seed_exact_pair_is_pulled_by_name_from_its_repositories(fake, pinned_catalog):
    """``pull gemma-4-e2b-it-qat-q4_0-exact --with-assistant``: the exact target from the repo the seed
    article links, the exact assistant from its recorded repository, the assistant's pinned sha256 checked."""
    drafter = os.urandom(5000)
    fake.add("xbill9/gemma-4-E2B-it-qat-q4_0-exact-gguf", {"gemma-4-E2B-it-qat-q4_0-exact.gguf": b"t" * 3000,
                                                          "mmproj-x.gguf": b"m"})
    fake.add("xbill9/gemma-4-E2B-it-qat-assistant-q4_0-exact-gguf",
             {"gemma-4-E2B-it-qat-assistant-q4_0-exact.gguf": drafter})
    with pytest.raises(ModelFileError) as exc:  # the published hash is pinned: other bytes are refused
        hub.pull("gemma-4-e2b-it-qat-q4_0-exact", with_assistant=True)
    assert catalog.get("gemma-4-e2b-it-qat-assistant-q4_0-exact").sha256 in str(exc.value)
    pinned_catalog("gemma-4-e2b-it-qat-assistant-q4_0-exact", drafter)
    target, assistant = hub.pull("gemma-4-e2b-it-qat-q4_0-exact", with_assistant=True)
    assert target.path.name == "gemma-4-E2B-it-qat-q4_0-exact.gguf"
    assert assistant.label.startswith("xbill9/gemma-4-E2B-it-qat-assistant-q4_0-exact-gguf:")
    assert assistant.path.read_bytes() == drafter and assistant.sha256 == hashlib.sha256(drafter).hexdigest()


def test_the_12b_tutorial_pair(fake):
    fake.add("google/gemma-4-12B-it-qat-q4_0-gguf", {"gemma-4-12B-it-qat-q4_0.gguf": b"t" * 100})
    fake.add("Janvitos/gemma-4-12B-it-qat-assistant-MTP-Q8_0-GGUF", {"assistant-Q8_0.gguf": b"a" * 100})
    target, assistant = hub.pull("gemma-4-12b-it-qat-gguf", with_assistant=True)
    assert assistant.label == "Janvitos/gemma-4-12B-it-qat-assistant-MTP-Q8_0-GGUF:assistant-Q8_0.gguf"
    assert catalog.pair(catalog.get("gemma-4-12b-it-qat-assistant-mtp-q8_0")).name == "gemma-4-12b-it-qat-gguf"


@pytest.mark.parametrize("spec,fail", [
    ("gemma-4-e2b-it-qat-gguf", r"^GET /api/models/.*/tree/"),  # list_repo_files (it raised past the wrapper)
    ("gemma-4-e2b-it-qat-gguf", r"^HEAD .*/resolve/"),  # hf_hub_download's metadata request
    ("gemma-4-e2b-it-qat-gguf", r"^GET .*/resolve/"),  # the download itself
    ("gemma-4-e2b-it-qat-assistant-q4_0-exact", r"/resolve/"),  # a catalog entry with one file
    ("acme/m:m.gguf", r"/resolve/"),
    ("gemma-4-e2b-it-qat", r"/api/models/"),  # a checkpoint directory: snapshot_download's listing
    ("gemma-4-e2b-it-qat", r"^GET .*/resolve/"),  # ... and its files
    ("acme/d", r"/api/models/"),
])
def test_network_failure_of_every_hub_call_is_one_error_line_soon(fake, capsys, spec, fail):
    """A hub that drops the connection at each kind of call: ``pull`` exits 1 with one ``error:`` line
    (no traceback, no retry chatter) after at most HUB_RETRIES retries of that request, in seconds
    (huggingface_hub's own budget is 5 retries over 23 s; list_repo_files' failure was a traceback)."""
    import time

    gguf = {"gemma-4-E2B-it-qat-q4_0.gguf": b"g" * 1000}
    fake.add("google/gemma-4-E2B-it-qat-q4_0-gguf", gguf)
    fake.add("xbill9/gemma-4-E2B-it-qat-assistant-q4_0-exact-gguf", {"gemma-4-E2B-it-qat-assistant-q4_0-exact.gguf": b"a"})
    fake.add("acme/m", {"m.gguf": b"m" * 1000})
    d = {"config.json": b'{"model_type": "x"}', "model.safetensors": b"s" * 1000}
    fake.add("google/gemma-4-E2B-it-qat-q4_0-unquantized", d)
    fake.add("acme/d", d)
    fake.fail.append(fail)
    t0 = time.monotonic()
    assert cli.main(["pull", spec]) == 1
    took = time.monotonic() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "cannot reach the hub" in err[0], err
    import re
    failed = [f"{m} {p}" for m, p, _ in fake.requests if re.search(fail, f"{m} {p}")]
    # each try may be sent twice: the HTTP client resends once on a kept-alive connection that drops
    assert failed and max(failed.count(f) for f in set(failed)) <= 2 * (1 + hub.HUB_RETRIES), failed
    assert took < 10, took


def test_models_json_for_scripts(fake, capsys):
    """``gemmaspec models --json``: every entry with its role, pair, repo, file, sha256 and cached path
    (None until pulled, the path after)."""
    import json

    fake.add("xbill9/gemma-4-E4B-it-qat-q4_0-exact-gguf", {"t.gguf": b"t" * 100})
    assert cli.main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {e.name for e in catalog.entries()}
    a = rows["gemma-4-e4b-it-qat-assistant-q4_0-exact"]
    assert (a["role"], a["repo"], a["file"], a["sha256"], a["cached"]) == (
        "assistant", "xbill9/gemma-4-E4B-it-qat-assistant-q4_0-exact-gguf",
        "gemma-4-E4B-it-qat-assistant-q4_0-exact.gguf",
        "dc965cb963e56b86fbc04db8efec83163886085e88514574650a57fa55a2ee24", None)
    assert rows["gemma-4-e4b-it-qat-q4_0-exact"]["pair"] == "gemma-4-e4b-it-qat-assistant-q4_0-exact"
    assert rows["gemma-3-270m-assistant"]["cached"]  # shipped in the package
    [got] = hub.pull("gemma-4-e4b-it-qat-q4_0-exact")
    assert cli.main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["gemma-4-e4b-it-qat-q4_0-exact"]["cached"] == str(got.path)
