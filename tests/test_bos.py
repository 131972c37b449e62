"""BOS as llama.cpp adds it (issue 31): a raw prompt to a ``gemma4`` GGUF starts with BOS exactly once
on every front end (the tokenizer, ``gemmaspec generate``, the server's /completion,
/v1/completions, /v1/chat/completions and /tokenize, streamed or not, speculation on or off); a
token-array prompt gets none added; a SentencePiece file whose ``tokenizer.ggml.add_bos_token`` is
false gets none (a gemma4 one gets BOS whatever the key says, as llama.cpp forces it). llama.cpp's
rule is ``llama_vocab::impl::load`` in src/llama-vocab.cpp."""

import json

import gguf
import httpx
import pytest

from conftest import ServerProcess, run_cli

pytestmark = pytest.mark.reference  # the tiny Gemma 4 checkpoint is built with transformers' classes

PROMPT = "hello world"
BOS_KEY = "tokenizer.ggml.add_bos_token"


def _with_add_bos(src, dst, add_bos):
    """A copy of GGUF ``src`` at ``dst`` whose ``tokenizer.ggml.add_bos_token`` is ``add_bos`` (None:
    no such key); everything else as it was."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", BOS_KEY):
            continue
        vtype = f.types[0]
        w.add_key_value(name, f.contents(), vtype, sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    if add_bos is not None:
        w.add_bool(BOS_KEY, add_bos)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _hf_target(d, add_bos_token):
    """A tiny random Gemma 4 checkpoint in ``d`` with a 300-token Gemma-style BPE vocabulary and a
    tokenizer_config.json that says ``add_bos_token``."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from test_gemma4_gguf import _SmallBPE
    from tiny_gemma4 import TARGET, randomize

    randomize(Gemma4ForCausalLM(Gemma4TextConfig(**TARGET)).eval(), 1).save_pretrained(d)
    _SmallBPE().backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": add_bos_token}))
    return d


@pytest.fixture(scope="module", autouse=True)
def home(tmp_path_factory):
    """A cache home without tokenizers for this module and the processes it starts: a tokenizer cached
    by another run (another gemmaspec) must not decide what these tests see. The compiled kernels are
    the usual ones (a link), not built again."""
    from gemmaspec.paths import cache_home

    kernels = cache_home() / "kernels"
    kernels.mkdir(exist_ok=True)
    home = tmp_path_factory.mktemp("home")
    (home / "kernels").symlink_to(kernels, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GEMMASPEC_HOME", str(home))
        yield


@pytest.fixture(scope="module")
def g4(tmp_path_factory):
    """A ``gemma4`` GGUF made by ``gemmaspec convert`` from a checkpoint that asks for BOS."""
    from gemmaspec.loading.convert import convert

    root = tmp_path_factory.mktemp("bos")
    out = root / "g4.gguf"
    convert(_hf_target(root / "hf", True), out, "f32")
    return out


@pytest.fixture(scope="module")
def tok(g4):
    return _tokenizer(g4)


def _tokenizer(path):
    from gemmaspec.loading.gguf import load_gguf

    return load_gguf(path, use_cache=False).tokenizer


# ---- llama.cpp's rule ------------------------------------------------------------------------------------

@pytest.mark.parametrize("model, pre, flag, want", [
    ("gemma4", None, None, True), ("gemma4", None, True, True),
    ("gemma4", None, False, True),  # llama.cpp's Gemma 4 workaround (#21500) overrides a false flag
    ("llama", "default", None, True), ("llama", None, False, False), ("llama", None, True, True),
    ("gpt2", "default", None, False), ("gpt2", "llama-bpe", None, True), ("gpt2", "llama-bpe", False, False),
    ("gpt2", "gemma4", False, True), ("gpt2", "default", True, True), ("t5", None, None, False),
    ("bert", None, None, True),
])
def test_the_rule_is_llama_cpps(model, pre, flag, want):
    from gemmaspec.loading.tokenizer_cache import llama_cpp_add_bos

    assert llama_cpp_add_bos(model, pre, flag) is want


# ---- the files and the tokenizer -------------------------------------------------------------------------

def test_convert_writes_add_bos_true_for_gemma4(g4, tmp_path):
    from gemmaspec.loading.convert import convert

    r = gguf.GGUFReader(g4)
    assert r.fields["tokenizer.ggml.model"].contents() == "gemma4" and r.fields[BOS_KEY].contents() is True
    # a checkpoint that says false still gets true, as llama.cpp's converter writes it (Gemma4Model.set_vocab)
    convert(_hf_target(tmp_path / "hf", False), tmp_path / "f.gguf", "f32")
    assert gguf.GGUFReader(tmp_path / "f.gguf").fields[BOS_KEY].contents() is True


@pytest.mark.parametrize("flag", [True, None, False])
def test_a_raw_prompt_to_a_gemma4_file_starts_with_one_bos(g4, tmp_path, flag):
    """Whatever the flag says (or its absence), as llama.cpp: a gemma4 vocabulary always adds BOS."""
    tok = _tokenizer(g4 if flag is True else _with_add_bos(g4, tmp_path / "v.gguf", flag))
    plain = tok.encode(PROMPT, add_bos=False)
    assert tok.add_bos and plain[0] != tok.bos_id
    assert tok.encode(PROMPT) == [tok.bos_id, *plain]
    assert tok.encode("<bos>" + PROMPT) == [tok.bos_id, *plain]  # never two
    chat = tok.encode_chat([{"role": "user", "content": PROMPT}])
    assert chat[0] == tok.bos_id and chat[1] != tok.bos_id


@pytest.mark.parametrize("flag, want", [(None, True), (True, True), (False, False)])
def test_a_sentencepiece_file_follows_its_flag(tmp_path, flag, want):
    """A ``llama`` (SentencePiece) vocabulary, Gemma 3's: BOS unless the file says false."""
    from test_mmap_load import _tiny_gguf

    tok = _tokenizer(_with_add_bos(_tiny_gguf(tmp_path / "g3.gguf"), tmp_path / "v.gguf", flag))
    plain = tok.encode("ab", add_bos=False)
    assert tok.add_bos is want and tok.encode("ab") == [tok.bos_id] * want + plain


@pytest.fixture(scope="module")
def spm_no_bos(tmp_path_factory):
    """The tokenizer of a SentencePiece (Gemma 3 style) file whose add_bos_token is false."""
    from test_mmap_load import _tiny_gguf

    d = tmp_path_factory.mktemp("spm")
    return _tokenizer(_with_add_bos(_tiny_gguf(d / "g3.gguf"), d / "v.gguf", False))


def test_a_chat_template_without_bos_gets_one_only_where_the_file_adds_it(spm_no_bos, tok):
    """llama-server tokenizes the rendered chat with add_special: BOS where the vocabulary adds it."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    msgs = [{"role": "user", "content": "ab"}]
    for t, bos in ((spm_no_bos, False), (tok, True)):
        t.chat_template, old = template, t.chat_template
        try:
            assert t.encode_chat(msgs) == [t.bos_id] * bos + t.encode("ab", add_bos=False)
        finally:
            t.chat_template = old


def test_tokenize_add_special_adds_no_bos_where_the_file_adds_none(spm_no_bos):
    """llama-server's /tokenize: ``add_special`` adds BOS only where the vocabulary does."""
    import asyncio
    from types import SimpleNamespace

    from gemmaspec.server.llama_routes import tokenize

    class Request:
        async def body(self):
            return json.dumps({"content": "ab", "add_special": True}).encode()

    st = SimpleNamespace(engine=SimpleNamespace(tokenizer=spm_no_bos))
    assert asyncio.run(tokenize(Request(), st))["tokens"] == spm_no_bos.encode("ab", add_bos=False)


def test_a_cache_entry_saved_without_bos_gets_it(g4, tmp_path, monkeypatch):
    """Entries cached before this fix hold transformers' false for a gemma4 vocabulary; the loader
    reads BOS from the file's header, so such an entry is still used, with BOS."""
    from gemmaspec.loading.gguf_header import read_header
    from gemmaspec.loading.tokenizer_cache import gguf_tokenizer, tokenizer_dir

    monkeypatch.setenv("GEMMASPEC_HOME", str(tmp_path / "home"))
    header = read_header(g4)
    assert gguf_tokenizer(header).add_bos
    meta = tokenizer_dir(header) / "tokenizer_meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "add_bos": False}))
    assert gguf_tokenizer(header).add_bos and not json.loads(meta.read_text())["add_bos"]  # the entry, kept


# ---- gemmaspec generate ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, spec, chat", [(PROMPT, "none", False), (PROMPT, "ngram-simple", False),
                                                ("<bos>" + PROMPT, "ngram-simple", False), (PROMPT, "none", True)])
def test_generate_counts_one_bos(g4, tok, prompt, spec, chat):
    res = run_cli("generate", "-m", str(g4), "-p", prompt, "-n", "2", "--temp", "0", "--json", "--spec-type", spec,
                  *(["--chat"] if chat else []))
    assert res.returncode == 0, res.stderr
    n = json.loads(res.stdout.strip().splitlines()[-1])["prompt_tokens"]
    want = tok.encode_chat([{"role": "user", "content": PROMPT}]) if chat else [tok.bos_id, *tok.encode(PROMPT, add_bos=False)]
    assert n == len(want)


# ---- the server ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(g4, tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("serve-bos"), "-m", str(g4), "-c", "256", "-np", "1",
                      "--spec-type", "ngram-simple")
    yield s
    s.close()


def _ask(srv, path, body, stream):
    """The response (not streamed) or the list of streamed events."""
    if not stream:
        r = httpx.post(srv.url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


SPEC = [{}, {"speculative.n_max": 0}]  # the server's speculation (ngram-simple), and off for the request


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("spec", SPEC)
def test_completion_prompt_gets_one_bos(srv, tok, stream, spec):
    n = len(tok.encode(PROMPT, add_bos=False)) + 1
    for prompt in (PROMPT, "<bos>" + PROMPT):
        out = _ask(srv, "/completion", {"prompt": prompt, "n_predict": 2, **spec}, stream)
        last = out[-1] if stream else out
        assert last["tokens_evaluated"] == n, prompt
        if not stream:
            assert out["prompt"] == "<bos>" + PROMPT
    # a token-array prompt is used as given, as llama-server does
    ids = tok.encode(PROMPT, add_bos=False)
    out = _ask(srv, "/completion", {"prompt": ids, "n_predict": 2, **spec}, stream)
    assert (out[-1] if stream else out)["tokens_evaluated"] == len(ids)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("spec", SPEC)
def test_v1_completions_prompt_gets_one_bos(srv, tok, stream, spec):
    plain = tok.encode(PROMPT, add_bos=False)
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    for prompt, n in ((PROMPT, len(plain) + 1), ("<bos>" + PROMPT, len(plain) + 1), (plain, len(plain)),
                      ([tok.bos_id, *plain], len(plain) + 1)):
        out = _ask(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 2, **extra, **spec}, stream)
        assert (out[-1] if stream else out)["usage"]["prompt_tokens"] == n, prompt


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("spec", SPEC)
def test_chat_prompt_gets_exactly_one_bos(srv, tok, stream, spec):
    msgs = [{"role": "user", "content": PROMPT}]
    want = tok.encode_chat(msgs)
    assert want[0] == tok.bos_id and want[1] != tok.bos_id
    extra = {"stream_options": {"include_usage": True}} if stream else {"verbose": True}
    out = _ask(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, **extra, **spec}, stream)
    assert (out[-1] if stream else out)["usage"]["prompt_tokens"] == len(want)
    if not stream:
        prompt = out["__verbose"]["prompt"]
        assert prompt.startswith("<bos>") and not prompt.startswith("<bos><bos>")


def test_tokenize_add_special_adds_one_bos(srv, tok):
    plain = tok.encode(PROMPT, add_bos=False)

    def tokens(content, **kw):
        return _ask(srv, "/tokenize", {"content": content, **kw}, False)["tokens"]

    assert tokens(PROMPT) == plain and tokens(PROMPT, add_special=False) == plain
    assert tokens(PROMPT, add_special=True) == [tok.bos_id, *plain]
    assert tokens("<bos>" + PROMPT, add_special=True) == [tok.bos_id, *plain]
    # without parse_special "<bos>" is text, and BOS comes before it
    as_text = tokens("<bos>" + PROMPT, add_special=True, parse_special=False)
    assert as_text == [tok.bos_id, *tok.encode_text("<bos>" + PROMPT)] and as_text.count(tok.bos_id) == 1
