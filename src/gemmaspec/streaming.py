"""Generated tokens → the text a user sees, as it streams: incremental detokenisation that never
splits a multi-byte character, and llama.cpp's stop conditions (stop tokens, stop strings held back
while they may still match, max tokens). Used by every request (:class:`gemmaspec.engine.RequestState`).
"""

from __future__ import annotations

from .sampling import SamplingParams
from .tokenizer import GemmaTokenizer


class IncrementalDecoder:
    """Turns a growing list of ids into text deltas without splitting multi-byte characters.

    ``push(ids)`` returns the new text; a trailing incomplete UTF-8 sequence (decoded as U+FFFD) is
    held back until the tokens that complete it arrive. ``flush()`` returns whatever is left.
    """

    def __init__(self, tokenizer: GemmaTokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids before this are settled
        self.read = 0  # ids before this have been emitted

    def push(self, new_ids) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            delta = text[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(prefix_text):]


class StopChecker:
    """Token-by-token stop conditions: stop ids, stop strings (held back while they may still
    match), max tokens. ``add`` returns the text that is safe to show."""

    def __init__(self, tok: GemmaTokenizer, params: SamplingParams):
        self.tok, self.params = tok, params
        self.decoder = IncrementalDecoder(tok)
        self.text = ""  # all decoded text
        self.shown = 0  # chars of text already returned
        self.tokens: list[int] = []
        self.reason = ""

    def add(self, token: int) -> str | None:
        """Feed one generated token; returns text to show, or None when the token is a stop token."""
        if token in self.tok.stop_ids and not self.params.ignore_eos:
            self.reason = "eos"
            return None
        self.tokens.append(token)
        self.text += self.decoder.push([token])
        out_end = len(self.text)
        for s in self.params.stop:
            i = self.text.find(s, max(0, self.shown - len(s)))
            if i >= 0:
                self.reason = "stop"
                out_end = min(out_end, i)
        if self.reason == "stop":
            self.text = self.text[:out_end]
        else:
            # hold back a tail that could be the start of a stop string
            for s in self.params.stop:
                for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:n]):
                        out_end = min(out_end, len(self.text) - n)
                        break
            if self.params.max_tokens != -1 and len(self.tokens) >= self.params.max_tokens:
                self.reason = "length"
                out_end = len(self.text)
        out = self.text[self.shown:out_end] if out_end > self.shown else ""
        self.shown = max(self.shown, out_end)
        return out

    def finish(self) -> str:
        if self.reason == "stop":
            return ""
        self.text += self.decoder.flush()
        out = self.text[self.shown:]
        self.shown = len(self.text)
        return out
