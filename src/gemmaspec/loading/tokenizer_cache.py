"""The tokenizer cache: the one thing gemmaspec writes when it loads a GGUF.

Building a Gemma tokenizer from a GGUF's vocabulary goes through transformers' converter (several
seconds, plus ~1.5 s to import transformers), and loading the result from a ``tokenizer.json`` takes
~1.8 s (``tokenizers`` parses 514,906 merges). So the first load of a vocabulary builds it, derives
the same BPE as a SentencePiece model (:mod:`gemmaspec.spm_tokenizer`; checked against the
``tokenizers`` one on sample text before it is kept) and saves both in ``<cache>/tokenizers/<key>/``
(``tokenizer.json``, ``tokenizer.model``, ``tokenizer_meta.json``). Later loads read only the
SentencePiece model (~0.1 s); ``tokenizer.json`` is loaded only if something asks for the
``tokenizers`` object.

The key is a hash of the metadata the tokenizer is built from (the raw bytes of every
``tokenizer.*`` entry and of ``general.architecture``, which picks the converter), not of the file's
path, size and modification time: it costs ~10 ms per load, and in exchange a moved, copied or
re-downloaded file still hits, files that share a vocabulary (quantizations of one model) share one
entry, and a different file at the same path can never be served a stale tokenizer.

Entries are written to a temporary directory and renamed into place, so a reader sees a whole entry
or none; an entry that fails to load (damaged, edited) is removed and built again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import ModelFileError
from ..paths import cache_home
from ..tokenizer import GemmaTokenizer
from .gguf_header import GGUFHeader

log = logging.getLogger(__name__)

CACHE_VERSION = 3  # bump when what is saved, or how it is built, changes


# llama.cpp, src/llama-vocab.cpp, llama_vocab::impl::load: the vocabulary types that add BOS unless the
# file says otherwise (SPM "llama", WPM "bert"; UGM "t5", RWKV and BPE do not), the BPE types
# ("tokenizer.ggml.model") and the BPE pre-tokenizers ("tokenizer.ggml.pre") that turn BOS on, and the
# pre-tokenizers of LLAMA_VOCAB_PRE_TYPE_GEMMA4 ("gemma4" is also forced for a "gemma4" model).
_BOS_MODELS = frozenset({"llama", "bert"})
_BPE_MODELS = frozenset({"gpt2", "hybriddna", "whitespace", "gemma4"})
_BOS_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                      "jina-v5-nano", "tekken", "chameleon"})
_GEMMA4_PRE = frozenset({"gemma4", "granite-embed-multi-311m"})


def llama_cpp_add_bos(model: str | None, pre: str | None, flag: bool | None) -> bool:
    """Whether llama.cpp adds BOS to a prompt it tokenizes with special tokens, for a GGUF whose
    ``tokenizer.ggml.model`` is ``model``, ``tokenizer.ggml.pre`` is ``pre`` and
    ``tokenizer.ggml.add_bos_token`` is ``flag`` (None: absent).

    As llama.cpp's ``llama_vocab::impl::load`` (src/llama-vocab.cpp) decides it: the vocabulary
    type's default (SPM ``llama`` and WPM ``bert``: yes; BPE: only for the llama3 / tekken /
    chameleon pre-tokenizers; UGM, RWKV: no), then the file's flag when it has one, then the Gemma 4
    workaround (ggml-org/llama.cpp#21500): a ``gemma4`` vocabulary (its pre-tokenizer is always
    ``gemma4``) adds BOS even when the flag says false, since the base Gemma 4 models degrade without
    it. A file without ``tokenizer.ggml.model`` is taken as SPM (llama.cpp refuses it; Gemma wants BOS).
    """
    if model == "gemma4":
        pre = "gemma4"
    bpe = model in _BPE_MODELS
    add = model is None or model in _BOS_MODELS or (bpe and pre in _BOS_PRE)
    if flag is not None:
        add = bool(flag)
    return add or (bpe and pre in _GEMMA4_PRE)


def gguf_add_bos(header: GGUFHeader) -> bool:
    """:func:`llama_cpp_add_bos` of ``header``'s tokenizer keys."""
    return llama_cpp_add_bos(header.get("tokenizer.ggml.model"), header.get("tokenizer.ggml.pre"),
                             header.get("tokenizer.ggml.add_bos_token"))


def tokenizer_key(header: GGUFHeader) -> str:
    """The cache key of ``header``'s tokenizer (hex): a hash of the tokenizer metadata's raw bytes."""
    keys = [k for k in header.fields if k.startswith("tokenizer.")] + ["general.architecture"]
    h = hashlib.sha256(f"gemmaspec-tokenizer-v{CACHE_VERSION}\0".encode())
    h.update(header.entry_bytes(keys))
    return h.hexdigest()[:24]


def tokenizer_dir(header: GGUFHeader) -> Path:
    """Where ``header``'s tokenizer is (or would be) cached."""
    return cache_home() / "tokenizers" / tokenizer_key(header)


def _load(entry: Path, header: GGUFHeader) -> GemmaTokenizer | None:
    """The cached tokenizer, or None when the entry is absent; a damaged one is removed."""
    if not entry.is_dir():
        return None
    try:
        tok = GemmaTokenizer.load(entry)
        n = header.fields["tokenizer.ggml.tokens"].count
        if tok.vocab_size < n:
            raise ValueError(f"{tok.vocab_size} tokens cached, the file has {n}")
        return tok
    except Exception as exc:  # anything wrong with an entry means: build it again
        log.warning("gemmaspec: the cached tokenizer in %s does not load (%s); rebuilding it", entry,
                    type(exc).__name__)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def _save(entry: Path, tok: GemmaTokenizer, header: GGUFHeader) -> None:
    """Write ``tok`` as ``entry`` atomically (temporary directory, then rename); a failure to write
    (read-only or full disk) is reported and otherwise ignored: the tokenizer is built next time."""
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
        tok.save(tmp)
        (tmp / "source.json").write_text(json.dumps({"built_from": str(header.path), "cache_version": CACHE_VERSION}))
        try:
            os.replace(tmp, entry)
        except OSError:  # another process saved it first
            pass
    except OSError as exc:
        log.warning("gemmaspec: could not save the tokenizer in %s (%s); it will be built again next time",
                    entry.parent, exc.strerror)
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def gguf_tokenizer(header: GGUFHeader, use_cache: bool = True) -> GemmaTokenizer:
    """The tokenizer of a target GGUF: from the cache, or built (and, with ``use_cache``, saved).

    A build says so in the log (``gemmaspec`` logger, INFO; one line), since it takes seconds.
    Whether prompts get BOS is read from the header on every load (:func:`gguf_add_bos`, llama.cpp's
    rule), not from the entry: entries saved before gemmaspec followed llama.cpp there hold
    transformers' ``false`` for a ``gemma4`` vocabulary.

    Raises:
        ModelFileError: the file has no vocabulary, or it cannot be converted.
    """
    if "tokenizer.ggml.tokens" not in header.fields:
        raise ModelFileError(f"{header.path}: the file has no tokenizer (tokenizer.ggml.tokens); it cannot generate text")
    entry = None
    if use_cache:
        try:
            entry = tokenizer_dir(header)
        except OSError as exc:  # the cache directory cannot be created
            log.warning("gemmaspec: no tokenizer cache (%s); building the tokenizer (a few seconds)", exc)
    add_bos = gguf_add_bos(header)
    if entry is not None:
        tok = _load(entry, header)
        if tok is not None:
            tok.add_bos = add_bos
            return tok
        log.info("gemmaspec: building the tokenizer of %s (first use of this vocabulary, a few seconds); later "
                 "starts reuse it from %s", header.path.name, entry.parent)
    tok = GemmaTokenizer.from_gguf(header.path, header.get("tokenizer.chat_template"), add_bos)
    why = tok.add_fast_path()
    if why is not None:
        log.warning("gemmaspec: this vocabulary has no fast tokenizer (%s); each start loads it with tokenizers "
                    "(~2 s)", why)
    if entry is not None:
        _save(entry, tok, header)
    return tok
