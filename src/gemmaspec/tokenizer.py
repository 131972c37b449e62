"""Tokenizer built from a GGUF's vocabulary, and the Gemma chat template.

The tokenizer is transformers' own GGUF conversion (``transformers.integrations.gguf.
gguf_tokenizer_mapping``: the file's SentencePiece vocabulary and merges handed to a ``tokenizers``
BPE model), so our ids equal the reference's. Building it takes seconds, so the loader keeps it in the tokenizer cache
(:mod:`gemmaspec.loading.tokenizer_cache`), both as ``tokenizer.json`` (~1.8 s to load) and as the
same BPE in a SentencePiece model (~0.1 s; :mod:`gemmaspec.spm_tokenizer`), which serves encode and
decode; the ``tokenizers`` object is loaded only when something asks for :attr:`GemmaTokenizer.backend`.

Whether prompts get BOS is the loader's to say (:attr:`GemmaTokenizer.add_bos`; for a GGUF, llama.cpp's
rule: :func:`gemmaspec.loading.tokenizer_cache.llama_cpp_add_bos`). The chat template is the file's
``tokenizer.chat_template`` when present, else Gemma's built-in turn format (below).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from .errors import InputError, ModelFileError

# Gemma's turn format (Gemma 3 model card / tokenizer_config.json): a system message is folded into
# the first user turn; the assistant role is called "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@functools.lru_cache(maxsize=None)
def template_extensions() -> tuple:
    """Jinja extensions chat templates get, as transformers gives them: ``{% break %}`` /
    ``{% continue %}`` and ``{% generation %}...{% endgeneration %}`` (it marks the assistant's tokens
    for training masks; rendered as its body). Built on first use: importing Jinja costs start-up time
    that a raw-text prompt does not need."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return ("jinja2.ext.loopcontrols", Generation)


def _strftime_now(fmt: str) -> str:
    """Today's local date and time in ``fmt`` (``strftime``), for chat templates that write the date."""
    import datetime

    return datetime.datetime.now().strftime(fmt)


class GemmaTokenizer:
    """Text ↔ token ids for a Gemma model.

    Attributes:
        bos_id, eos_id: special token ids from the file.
        add_bos: whether :meth:`encode` prepends BOS by default.
        chat_template: the Jinja template :meth:`apply_chat_template` renders.
        stop_ids: ids that end generation (EOS and ``<end_of_turn>`` when the vocabulary has it).
    """

    def __init__(self, backend, bos_id: int, eos_id: int, add_bos: bool, chat_template: str | None,
                 fast=None, backend_loader=None):
        """``backend``: a ``tokenizers.Tokenizer`` (or None with ``backend_loader``, a callable that
        loads it when something needs it); ``fast``: an optional
        :class:`gemmaspec.spm_tokenizer.SpmText` that encodes and decodes with the same results."""
        self._backend, self._backend_loader, self.fast = backend, backend_loader, fast
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.chat_template_from_file = chat_template
        self.chat_template = chat_template or GEMMA_CHAT_TEMPLATE
        self.vocab_size = fast.size if fast is not None else backend.get_vocab_size(with_added_tokens=True)
        stops = {eos_id}
        for name in ("<end_of_turn>", "<turn|>"):
            tid = self.token_to_id(name)
            if tid is not None:
                stops.add(tid)
        self.stop_ids = frozenset(stops)

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` (loaded on first use when the fast path serves the rest: ~1-2 s)."""
        if self._backend is None:
            self._backend = self._backend_loader()
            self._backend.post_processor = None
        return self._backend

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: Path, chat_template: str | None = None, add_bos: bool | None = None) -> "GemmaTokenizer":
        """Build from the GGUF's ``tokenizer.ggml.*`` metadata (transformers' converter), with the
        file's ``tokenizer.chat_template`` (None: Gemma's built-in template).

        ``add_bos``: whether prompts get BOS; None takes transformers' reading of the file, which
        differs from llama.cpp's for a Gemma 4 vocabulary (it says no BOS, its reference tokenizer
        leaving BOS to the chat template), so the loader passes llama.cpp's
        (:func:`gemmaspec.loading.tokenizer_cache.gguf_tokenizer`).

        Raises:
            ModelFileError: the file's tokenizer cannot be converted.
        """
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

        try:
            arch, tok_dict, tok_config = get_gguf_tokenizer(str(path))
            backend, _ = convert_gguf_tokenizer(arch, tok_dict)
        except Exception as exc:  # the converter raises many kinds on odd files
            raise ModelFileError(f"{path}: cannot build the tokenizer from the file ({type(exc).__name__}: {exc})") from None
        backend.post_processor = None  # BOS is added here, per add_bos, not by the backend
        if add_bos is None:
            add_bos = bool(tok_config.get("add_bos_token", True))
        return cls(backend, int(tok_dict.get("bos_token_id", 2)), int(tok_dict.get("eos_token_id", 1)), add_bos,
                   chat_template)

    @classmethod
    def from_hf_dir(cls, directory: Path, config: dict | None = None) -> "GemmaTokenizer":
        """From a Hugging Face checkpoint's ``tokenizer.json`` (+ ``tokenizer_config.json``,
        ``chat_template.jinja`` when present).

        Raises:
            ModelFileError: no tokenizer.json, or it does not load.
        """
        from tokenizers import Tokenizer

        directory = Path(directory)
        tj = directory / "tokenizer.json"
        if not tj.exists():
            raise ModelFileError(f"{directory} has no tokenizer.json; gemmaspec needs the checkpoint's tokenizer")
        try:
            backend = Tokenizer.from_file(str(tj))
        except Exception as exc:  # tokenizers raises its own Exception subclass
            raise ModelFileError(f"{tj} does not load as a tokenizer ({exc})") from None
        backend.post_processor = None
        tc = {}
        tcf = directory / "tokenizer_config.json"
        if tcf.exists():
            try:
                tc = json.loads(tcf.read_text())
            except ValueError as exc:
                raise ModelFileError(f"{tcf} is not valid JSON ({exc})") from None
        config = config or {}
        text_cfg = config.get("text_config", config)

        def special(key, name, default):
            tid = text_cfg.get(key, config.get(key))
            if isinstance(tid, list):
                tid = tid[0]
            if tid is None:
                tid = backend.token_to_id(tc.get(name) if isinstance(tc.get(name), str) else f"<{name[:-6]}>")
            return default if tid is None else int(tid)

        template = tc.get("chat_template")
        jinja = directory / "chat_template.jinja"
        if template is None and jinja.exists():
            template = jinja.read_text()
        return cls(backend, special("bos_token_id", "bos_token", 2), special("eos_token_id", "eos_token", 1),
                   bool(tc.get("add_bos_token", True)), template)

    def save(self, directory: Path) -> None:
        """Write ``tokenizer.json`` (compact: it loads ~1.5x faster than indented),
        ``tokenizer_meta.json`` and, when :meth:`add_fast_path` built one, ``tokenizer.model``."""
        self.backend.save(str(Path(directory) / "tokenizer.json"), pretty=False)
        meta = {"bos_id": self.bos_id, "eos_id": self.eos_id, "add_bos": self.add_bos,
                "chat_template": self.chat_template_from_file, "spm_controls": None}
        spm = getattr(self, "_spm", None)
        if spm is None and self.fast is not None:  # loaded from a cache entry: save what it was read from
            spm = (self.fast.model_bytes, self.fast.controls_list)
        if spm is not None:
            (Path(directory) / "tokenizer.model").write_bytes(spm[0])
            meta["spm_controls"] = spm[1]
        (Path(directory) / "tokenizer_meta.json").write_text(json.dumps(meta))

    @classmethod
    def load(cls, directory: Path) -> "GemmaTokenizer":
        """Read what :meth:`save` wrote: the SentencePiece fast path (``tokenizer.model``) when the
        entry has one, ``tokenizer.json`` then loaded only when needed. Raises OSError, ValueError,
        RuntimeError or ``tokenizers``' Exception when the files are missing or damaged."""
        from tokenizers import Tokenizer

        directory = Path(directory)
        meta = json.loads((directory / "tokenizer_meta.json").read_text())
        tj = directory / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(tj)
        fast = None
        if meta.get("spm_controls") is not None:
            from .spm_tokenizer import SpmText

            fast = SpmText(directory / "tokenizer.model", meta["spm_controls"])
            backend = None
        else:
            backend = Tokenizer.from_file(str(tj))
        return cls(backend, meta["bos_id"], meta["eos_id"], meta["add_bos"], meta["chat_template"], fast=fast,
                   backend_loader=lambda: Tokenizer.from_file(str(tj)))

    def add_fast_path(self) -> str | None:
        """Build the SentencePiece fast path from the ``tokenizers`` backend and check it on sample
        text; keep it when they agree. Returns None, or why there is no fast path."""
        from .spm_tokenizer import NotReproducible, SpmText, build_model, self_check
        import tempfile

        try:
            blob, controls = build_model(self.backend)
        except (NotReproducible, ImportError) as exc:
            return str(exc)
        with tempfile.TemporaryDirectory() as d:
            f = Path(d) / "tokenizer.model"
            f.write_bytes(blob)
            try:
                fast = SpmText(f, controls)
                why = self_check(self.backend, fast)
            except Exception as exc:  # SentencePiece refuses the model (RuntimeError) or fails on a text
                return f"SentencePiece: {exc}"
        if why is not None:
            return why
        self._spm = (blob, controls)
        self.fast = fast
        return None

    # -- use -------------------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special-token strings in it (``<start_of_turn>``) become their ids.
        BOS is prepended when ``add_bos`` (default: the file's setting) says so and the text does not
        already begin with it (never two)."""
        if self.fast is not None:
            ids = self.fast.encode(text)
        else:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids) -> str:
        """Text of ``ids`` (control tokens written as their text)."""
        if self.fast is not None:
            return self.fast.decode(ids)
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        if self.fast is not None:
            return self.fast.piece_to_id(token)
        return self.backend.token_to_id(token)

    def id_to_token(self, tid: int) -> str | None:
        """The vocabulary's spelling of token ``tid`` ('▁' for a space, ``<0xE4>`` for a byte), or None."""
        if self.fast is not None:
            return self.fast.id_to_piece(tid)
        return self.backend.id_to_token(tid)

    def get_vocab(self) -> dict[str, int]:
        """{token spelling: id} over the whole vocabulary, added tokens included."""
        if self.fast is not None:
            return self.fast.vocab()
        return self.backend.get_vocab()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final: bool = False, template_kwargs: dict | None = None) -> str:
        """Render chat ``messages`` ([{"role": "user"|"system"|"assistant", "content": str}]) as text.

        ``continue_final``: the last message (an assistant's) is left open, so the model continues
        it: the text up to where the template puts its content, then the content as given (no end
        of turn, no generation prompt; llama-server's assistant prefill, vLLM's
        ``continue_final_message``).

        ``template_kwargs``: more variables for the template (llama-server's and vLLM's
        ``chat_template_kwargs``, e.g. ``{"enable_thinking": false}`` for a template that reads it);
        they cannot replace the ones set here (``messages``, ``add_generation_prompt``, ``bos_token``...).

        Raises:
            InputError: a message without role/content, a role the template rejects, or (with
                ``continue_final``) a template that does not write the last message's content.
        """
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InputError("each chat message needs a string 'role' and a string 'content'")

        def raise_exception(msg):
            raise InputError(f"chat template: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=list(template_extensions()))
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = _strftime_now  # as transformers gives templates (dates in system prompts)
        # templates may also use {% break %} / {% continue %} (transformers enables loopcontrols) and
        # llama.cpp's date_string and datetime variables (today, "%d %b %Y" and "%b %d %Y")
        mark = "\ufdd2"
        if continue_final:
            if not messages or any(mark in m["content"] for m in messages):
                raise InputError("nothing to continue (no messages), or message content contains U+FDD2")
            final = messages[-1]["content"]
            messages = [*messages[:-1], {**messages[-1], "content": mark}]
            add_generation_prompt = False
        try:
            import datetime

            now = datetime.datetime.now()
            text = env.from_string(self.chat_template).render(
                **(template_kwargs or {}), messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.id_to_token(self.bos_id), eos_token=self.id_to_token(self.eos_id),
                date_string=now.strftime("%d %b %Y"), datetime=now.strftime("%b %d %Y"))  # as llama.cpp gives them
        except jinja2.TemplateError as exc:
            raise InputError(f"chat template failed: {exc}") from None
        if continue_final:
            if text.count(mark) != 1:
                raise InputError("this chat template does not write the final message's content, so it cannot be "
                                 "continued")
            text = text[:text.index(mark)] + final
        return text

    def encode_text(self, text: str, add_bos: bool | None = False) -> list[int]:
        """Token ids of ``text`` with every character taken as text: a control-token spelling in it
        (``<start_of_turn>``, ``<bos>``) is tokenized as the characters it is made of, never as the
        control token."""
        if self.fast is not None:
            ids = self.fast.encode_plain(text)
        else:
            backend = self.backend
            old = backend.encode_special_tokens
            backend.encode_special_tokens = True
            try:
                ids = backend.encode(text, add_special_tokens=False).ids if text else []
            finally:
                backend.encode_special_tokens = old
        if (self.add_bos if add_bos is None else add_bos) and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the control tokens (added tokens marked special: ``<bos>``, ``<start_of_turn>``...)."""
        if getattr(self, "_special_ids", None) is None:
            if self.fast is not None:
                self._special_ids = self.fast.control_ids
            else:
                self._special_ids = frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)
        return self._special_ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """Ids of the rendered chat prompt, with BOS exactly once where the model adds it: the
        template's own ``<bos>`` is that BOS, and one is added only to a rendering that lacks it
        (llama-server strips the template's BOS and lets the tokenizer add it: common/chat.cpp,
        ``common_chat_template_direct_apply``; same ids). ``add_generation_prompt``, ``continue_final``
        and ``template_kwargs`` as in :meth:`apply_chat_template`.

        Message contents are text: a control-token spelling inside one (``<end_of_turn>`` typed by a
        user) is tokenized as characters, so a message cannot forge a turn. Only the template's own
        text yields control tokens.

        Raises:
            InputError: bad messages (see :meth:`apply_chat_template`), or a template that changes
                message content in a way that hides where it lies while the content spells a control token.
        """
        opts = {"add_generation_prompt": add_generation_prompt, "continue_final": continue_final,
                "template_kwargs": template_kwargs}
        text = self.apply_chat_template(messages, **opts)
        specials = self.special_ids
        if not any(specials.intersection(self.encode(m["content"], add_bos=False))
                   for m in messages if m["content"]):
            return self.encode(text)
        return self._encode_chat_guarded(messages, text, opts)

    def _encode_chat_guarded(self, messages: list[dict], text: str, opts: dict | None = None) -> list[int]:
        """The rendered prompt with message contents marked (by rendering them wrapped in two
        noncharacters), split at the template's control tokens only; each run between them is
        tokenized as text. For content without control-token spellings this gives the ids plain
        encoding gives (both split at control tokens and tokenize the runs between)."""
        import re

        start, end = "\ufdd0", "\ufdd1"
        for m in messages:
            if start in m["content"] or end in m["content"]:
                raise InputError("message content contains U+FDD0 or U+FDD1 (noncharacters); remove them")

        def wrap(content: str) -> str:
            # the marks go inside the content's leading and trailing whitespace, so a template that
            # trims some contents (Gemma's trims turns, not the system prefix) keeps every mark
            if not content:
                return content
            core = content.strip()
            i = len(content) - len(content.lstrip())
            return content[:i] + start + core + end + content[i + len(core):]

        marked = self.apply_chat_template([{**m, "content": wrap(m["content"])} for m in messages], **(opts or {}))
        if marked.replace(start, "").replace(end, "") != text:
            raise InputError("this chat template transforms message content, so control-token text in a message "
                             "(such as <start_of_turn>) cannot be kept as text; remove it from the message")
        # pieces: (text, is_content)
        pieces, i = [], 0
        while i < len(marked):
            a = marked.find(start, i)
            if a < 0:
                pieces.append((marked[i:], False))
                break
            b = marked.index(end, a)
            pieces += [(marked[i:a], False), (marked[a + 1:b], True)]
            i = b + 1
        ids, run = [], []
        for piece, is_content in pieces:
            if is_content or not piece:
                run.append(piece)
                continue
            found = [t for t in self.encode(piece, add_bos=False) if t in self.special_ids]
            if not found:
                run.append(piece)
                continue
            names = sorted({self.id_to_token(t) for t in found}, key=len, reverse=True)
            parts = re.split("(" + "|".join(map(re.escape, names)) + ")", piece)
            for j, part in enumerate(parts):
                if j % 2:  # a control token of the template
                    ids += self.encode_text("".join(run))
                    run = []
                    ids.append(self.token_to_id(part))
                else:
                    run.append(part)
        ids += self.encode_text("".join(run))
        if self.add_bos and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids
