"""The catalog's shape (every entry's source, pair and file fields), the Gemma 3 instruction-tuned GGUFs to
chat with (pulled by name from a local fake hub, tests/fake_hub.py, and resolved as ``-m NAME``), and the
base-model check that ``chat``, ``generate --chat`` and ``serve`` speak from. No internet."""

import json

import pytest
from fake_hub import serve_fake_hub

from gemmaspec import cli
from gemmaspec.manage import catalog, hub


@pytest.fixture
def fake(tmp_path, monkeypatch):
    h = serve_fake_hub(monkeypatch, tmp_path)
    yield h
    h.close()


def test_every_entry_is_well_formed():
    data = json.loads(catalog.CATALOG_FILE.read_text())
    names = [m["name"] for m in data["models"]]
    assert len(names) == len(set(names)) and all(n == n.lower() for n in names)
    for e in catalog.entries():
        assert e.source in catalog.sources(), e.name
        assert e.role in ("target", "assistant"), e.name
        assert not (e.file and e.file_glob), e.name  # one file, or one picked from the listing
        if e.format == "gguf" and not e.placeholder:
            assert e.file or e.file_glob, e.name
        partner = catalog.pair(e)
        if e.assistant or e.target:
            assert partner is not None and partner.role != e.role, e.name
        if e.draft_n_max is not None:
            assert e.draft_n_max_source in catalog.sources(), e.name
        assert not e.extra, (e.name, e.extra)  # a misspelt field would be silently ignored


@pytest.mark.parametrize("name", catalog.CHAT_MODELS)
def test_the_chat_models_are_gemma3_instruct_gguf_targets(name):
    e = catalog.get(name)
    assert e.role == "target" and e.format == "gguf" and e.repo and not e.placeholder
    assert "-it" in e.repo.lower() and (e.file or e.file_glob).endswith("4_0.gguf") and e.qat


def test_pull_gemma_3_1b_it_fetches_the_recorded_file_and_resolves_as_m(fake, capsys):
    """``gemmaspec pull gemma-3-1b-it``: Google's QAT GGUF from its repository (not the vision projector
    beside it), checked against the hub's LFS hash; then ``-m gemma-3-1b-it`` is that file (before the
    pull it says which pull to run)."""
    data = b"not really a model " * 500
    fake.add("google/gemma-3-1b-it-qat-q4_0-gguf", {"gemma-3-1b-it-q4_0.gguf": data, "mmproj-x.gguf": b"m"})
    assert cli.main(["chat", "-m", "gemma-3-1b-it"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "`gemmaspec pull gemma-3-1b-it` first" in err[0], err
    assert cli.main(["pull", "gemma-3-1b-it"]) == 0
    out = capsys.readouterr().out
    path, entry = hub.resolve("gemma-3-1b-it")
    assert entry.name == "gemma-3-1b-it" and open(path, "rb").read() == data
    assert out.startswith("google/gemma-3-1b-it-qat-q4_0-gguf:gemma-3-1b-it-q4_0.gguf: ") and path in out
    got = [p for m, p, _ in fake.requests if m == "GET" and "/resolve/" in p]
    assert got and all(p.startswith("/google/gemma-3-1b-it-qat-q4_0-gguf/resolve/") and
                       p.endswith("/gemma-3-1b-it-q4_0.gguf") for p in got), got
    # -m NAME reaches the loader with the cached file (these bytes are no model: the loader says so)
    assert cli.main(["chat", "-m", "gemma-3-1b-it"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a GGUF file" in err[0] and "gemmaspec pull" not in err[0], err


def test_pull_gemma_3_270m_it_picks_the_q4_0_file_from_the_listing(fake):
    fake.add("unsloth/gemma-3-270m-it-qat-GGUF", {
        "gemma-3-270m-it-qat-Q4_0.gguf": b"q4" * 100, "gemma-3-270m-it-qat-Q8_0.gguf": b"q8" * 100,
        "gemma-3-270m-it-qat-UD-Q4_K_XL.gguf": b"k" * 100, "README.md": b"r"})
    [got] = hub.pull("gemma-3-270m-it")
    assert got.path.name == "gemma-3-270m-it-qat-Q4_0.gguf" and got.path.read_bytes() == b"q4" * 100
    assert hub.resolve("gemma-3-270m-it")[0] == str(got.path)


def test_is_base_reads_the_files_chat_template(tmp_path, model_path):
    """A base model is one whose file carries no chat template: the embedded default model (its GGUF has
    none); a checkpoint directory without, then with, ``chat_template.jinja``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from gemmaspec.loading.gguf_header import read_header
    from gemmaspec.loading.tokenizer_cache import gguf_tokenizer
    from gemmaspec.tokenizer import GemmaTokenizer

    assert catalog.is_base(gguf_tokenizer(read_header(model_path)))
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "hi": 4}
    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    assert catalog.is_base(GemmaTokenizer.from_hf_dir(tmp_path))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert not catalog.is_base(GemmaTokenizer.from_hf_dir(tmp_path))


def test_the_base_model_note_names_pullable_chat_models():
    note = catalog.base_model_note()
    assert "base (pretrained) model" in note and "gemmaspec pull gemma-3-1b-it" in note
    assert all(name in note for name in catalog.CHAT_MODELS)
