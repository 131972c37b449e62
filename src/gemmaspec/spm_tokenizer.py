"""The fast path of a Gemma tokenizer: the same BPE run by SentencePiece, which loads in ~0.1 s.

``tokenizers`` needs ~1.8 s to load a 262,144-token Gemma vocabulary with its 514,906 merges (the
merges are ~75% of it), which alone is more than the cold-start budget. SentencePiece, Google's own
tokenizer library and the one Gemma's vocabularies come from, loads the same vocabulary in ~0.1 s
because its BPE needs no merge list: it merges the adjacent pair whose joined piece has the best
score (``bpe_model.cc``). A ``tokenizers`` BPE instead applies the merge with the lowest rank, and
transformers' GGUF converter ranks merges by the joined token's score, ties by id
(``gguf_tokenizer_mapping``/``GGUFTokenizerSkeleton``). So giving every piece the score
``-(rank of the first merge that makes it)`` makes SentencePiece take the same merges in the same
order; added tokens become SentencePiece's control (special) and user-defined (non-special,
matched in text) pieces. Spaces are replaced by U+2581 before SentencePiece sees the text, as the
``tokenizers`` normalizer does.

:func:`build_model` builds that model from a ``tokenizers`` tokenizer (once, at the first use of a
vocabulary; the tokenizer cache keeps the file) and refuses any tokenizer whose pipeline it does not
reproduce; :func:`self_check` compares both on text before the file is kept. :class:`SpmText`
encodes and decodes with llama.cpp/transformers' results (tests: ``tests/test_tokenizer.py``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_SPACE = "\u2581"
_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class NotReproducible(ValueError):
    """The ``tokenizers`` pipeline has a step the SentencePiece model cannot reproduce."""


def build_model(backend) -> tuple[bytes, list[tuple[int, str]]]:
    """A SentencePiece ``ModelProto`` (serialized) equal to ``backend``'s BPE, and its control tokens.

    Args:
        backend: a ``tokenizers.Tokenizer`` with a BPE model (byte fallback), the normalizer
            ``Replace(' ', '▁')``, no pre-tokenizer or a split on ' ' (a no-op after the normalizer),
            and the decoder ``Replace('▁', ' ')`` + ``ByteFallback`` + ``Fuse`` (Gemma's).

    Returns:
        (model bytes, [(id, text)] of the special added tokens, which :class:`SpmText` matches in
        text itself since SentencePiece never matches control pieces).

    Raises:
        NotReproducible: any other pipeline (the caller keeps using ``tokenizers``).
    """
    from sentencepiece import sentencepiece_model_pb2 as pb

    j = json.loads(backend.to_str())
    model = j.get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback") or model.get("dropout") \
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise NotReproducible("not a byte-fallback BPE without dropout or affixes")
    if j.get("normalizer") != {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}:
        raise NotReproducible(f"normalizer {j.get('normalizer')}")
    pre = j.get("pre_tokenizer")
    if pre is not None and not (pre.get("type") == "Split" and pre.get("pattern") == {"String": " "}):
        raise NotReproducible(f"pre-tokenizer {pre}")
    dec = j.get("decoder") or {}
    kinds = [d.get("type") for d in dec.get("decoders", [])]
    if kinds != ["Replace", "ByteFallback", "Fuse"]:
        raise NotReproducible(f"decoder {kinds}")
    vocab: dict[str, int] = model["vocab"]
    added = {a["id"]: a for a in j.get("added_tokens", [])}
    for a in added.values():
        if a.get("lstrip") or a.get("rstrip") or a.get("single_word"):
            raise NotReproducible(f"added token {a['content']!r} strips or matches whole words")
    n = max([*vocab.values(), *added]) + 1
    pieces: list[str | None] = [None] * n
    for t, i in vocab.items():
        pieces[i] = t
    for i, a in added.items():
        if pieces[i] not in (None, a["content"]):
            raise NotReproducible(f"id {i} is {pieces[i]!r} in the vocabulary and {a['content']!r} as an added token")
        pieces[i] = a["content"]
    if None in pieces or len(set(pieces)) != n:
        raise NotReproducible("ids are not one piece each")
    big = len(model["merges"]) + n
    rank = [big + i for i in range(n)]  # pieces no merge makes: never the result of a merge
    for k, m in enumerate(model["merges"]):
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        i = vocab[a + b]
        if rank[i] >= big:
            rank[i] = k
    if sum(1 for t in pieces if _BYTE.match(t)) != 256:
        raise NotReproducible("byte fallback without the 256 byte tokens")
    unk = vocab.get(model.get("unk_token") or "", None)
    if unk is None:
        raise NotReproducible("no unknown token")
    mp = pb.ModelProto()
    kind = pb.ModelProto.SentencePiece.Type
    controls = []
    for i, t in enumerate(pieces):
        p = mp.pieces.add()
        p.piece, p.score = t, -float(rank[i])
        if i == unk:
            p.type = kind.UNKNOWN
            if i in added and added[i]["special"]:
                controls.append((i, t))  # "<unk>" written in text is the token, as an added token
        elif i in added:
            p.type = kind.CONTROL if added[i]["special"] else kind.USER_DEFINED
            if added[i]["special"]:
                controls.append((i, t))
        elif _BYTE.match(t):
            p.type = kind.BYTE
        else:
            p.type = kind.NORMAL
    mp.trainer_spec.model_type = pb.TrainerSpec.BPE
    mp.trainer_spec.vocab_size = n
    mp.trainer_spec.byte_fallback = True
    mp.trainer_spec.unk_id = unk
    for field in ("bos_id", "eos_id", "pad_id"):
        setattr(mp.trainer_spec, field, -1)  # ids are the file's; nothing is added by SentencePiece
    mp.normalizer_spec.name = "identity"
    mp.normalizer_spec.add_dummy_prefix = False
    mp.normalizer_spec.remove_extra_whitespaces = False
    mp.normalizer_spec.escape_whitespaces = False  # done by SpmText, as the tokenizers normalizer does
    return mp.SerializeToString(), controls


class SpmText:
    """Encode/decode with a model from :func:`build_model`.

    Args:
        model_file: the serialized model (``tokenizer.model``).
        controls: [(id, text)] of the special tokens.

    Raises:
        OSError / RuntimeError: the file is missing or not a SentencePiece model.
    """

    def __init__(self, model_file: Path, controls: list[tuple[int, str]]):
        import sentencepiece as spm

        self.controls_list = [(int(i), t) for i, t in controls]
        self.sp = spm.SentencePieceProcessor(model_proto=Path(model_file).read_bytes())
        self.size = self.sp.get_piece_size()
        self.controls = {t: int(i) for i, t in controls}
        self.control_ids = frozenset(self.controls.values())
        self._lengths = sorted({len(t) for t in self.controls}, reverse=True)
        firsts = sorted({t[0] for t in self.controls})
        self._first = re.compile("[" + "".join(re.escape(c) for c in firsts) + "]") if firsts else None

    @property
    def model_bytes(self) -> bytes:
        """The serialized model (``tokenizer.model``'s bytes), for saving: serialized again from the
        loaded model rather than kept (~5 MB for a 262,144-token vocabulary)."""
        return self.sp.serialized_model_proto()

    # -- encode ----------------------------------------------------------------------------------
    def encode_plain(self, text: str) -> list[int]:
        """Ids of ``text`` with every character as text (control spellings are characters)."""
        return self.sp.encode(text.replace(" ", _SPACE)) if text else []

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; control-token spellings in it (``<start_of_turn>``) become their ids
        (leftmost, longest first, as ``tokenizers``' added-token matching)."""
        if self._first is None:
            return self.encode_plain(text)
        ids: list[int] = []
        start = pos = 0
        while True:
            m = self._first.search(text, pos)
            if m is None:
                break
            i = m.start()
            for n in self._lengths:
                tid = self.controls.get(text[i:i + n])
                if tid is not None:
                    ids += self.encode_plain(text[start:i])
                    ids.append(tid)
                    start = pos = i + n
                    break
            else:
                pos = i + 1
        ids += self.encode_plain(text[start:])
        return ids

    # -- decode ----------------------------------------------------------------------------------
    def id_to_piece(self, tid: int) -> str | None:
        return self.sp.id_to_piece(tid) if 0 <= tid < self.size else None

    def piece_to_id(self, piece: str) -> int | None:
        tid = self.sp.piece_to_id(piece)
        return tid if self.sp.id_to_piece(tid) == piece else None

    def decode(self, ids) -> str:
        """Text of ``ids`` as ``tokenizers``' decoder writes it: '▁' → space, byte tokens joined into
        UTF-8 (a run of byte tokens that is not valid UTF-8 gives one U+FFFD per token), control
        tokens as their text.

        Raises:
            IndexError: an id outside the vocabulary.
        """
        ids = list(ids)
        for t in ids:
            if not 0 <= t < self.size:
                raise IndexError(f"token id {t} is outside the vocabulary (0..{self.size - 1})")
        out: list[str] = []
        run = bytearray()
        for tid, piece in zip(ids, self.sp.id_to_piece(ids)):
            if self.sp.is_byte(tid):
                run.append(int(piece[3:5], 16))
                continue
            if run:
                out.append(_bytes_text(run))
                run = bytearray()
            out.append(piece.replace(_SPACE, " "))
        if run:
            out.append(_bytes_text(run))
        return "".join(out)

    def vocab(self) -> dict[str, int]:
        """{piece: id} for the whole vocabulary."""
        return {p: i for i, p in enumerate(self.sp.id_to_piece(list(range(self.size))))}


def _bytes_text(run: bytearray) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


# A sample for the build-time check: code, prose, whitespace runs, bytes, every control token.
def self_check(backend, fast: SpmText, extra_texts=()) -> str | None:
    """Compare ``fast`` with ``backend`` on sample text; the first difference as a message, or None.

    The sample: ``extra_texts``, the standard library's ``pydoc_data.topics`` (~0.8 MB of prose and
    code), whitespace and newline runs, non-Latin scripts and emoji, and every control token inside
    text."""
    texts = list(extra_texts)
    try:
        from pydoc_data.topics import topics
        texts += list(topics.values())
    except ImportError:  # a Python built without its docs
        pass
    texts += [" " * n + "x" + "\n" * (n % 7) + "\t" * (n % 5) for n in range(1, 70)]
    texts += ["Ünïcödé café — “q” 日本語のテキスト 中文 한국어 😀🎉👩‍💻🇫🇷 ∑∫√π \u200b\ufeff\u00a0 ▁ x"]
    ctl = list(fast.controls)
    texts += ["a" + t + " b" + t + t + "  " for t in ctl]
    for t in texts:
        want = backend.encode(t, add_special_tokens=False).ids
        got = fast.encode(t)
        if got != want:
            return f"encode({t[:40]!r}...) differs"
        old = backend.encode_special_tokens
        backend.encode_special_tokens = True
        try:
            want_plain = backend.encode(t, add_special_tokens=False).ids
        finally:
            backend.encode_special_tokens = old
        if fast.encode_plain(t) != want_plain:
            return f"plain encode({t[:40]!r}...) differs"
        if fast.decode(want) != backend.decode(want, skip_special_tokens=False):
            return f"decode of {t[:40]!r}... differs"
    return None
