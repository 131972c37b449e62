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
    if entry is not None:
        tok = _load(entry, header)
        if tok is not None:
            return tok
        log.info("gemmaspec: building the tokenizer of %s (first use of this vocabulary, a few seconds); later "
                 "starts reuse it from %s", header.path.name, entry.parent)
    tok = GemmaTokenizer.from_gguf(header.path, header.get("tokenizer.chat_template"))
    why = tok.add_fast_path()
    if why is not None:
        log.warning("gemmaspec: this vocabulary has no fast tokenizer (%s); each start loads it with tokenizers "
                    "(~2 s)", why)
    if entry is not None:
        _save(entry, tok, header)
    return tok
