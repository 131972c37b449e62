"""Generated tokens → the text a user sees, as it streams: incremental detokenisation that never
splits a multi-byte character, and llama.cpp's stop conditions (stop tokens, stop strings held back
while they may still match, max tokens). Used by every request (:class:`gemmaspec.engine.RequestState`).
"""

from __future__ import annotations

import functools

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


class StopStrings:
    """Aho-Corasick matcher over stop strings, fed one character at a time.

    Feeding a character costs O(1) amortised plus the matches it completes, whatever the number of
    stop strings, and :attr:`depth` (the longest tail of the text that is a prefix of some stop
    string, i.e. what must be held back) is known after every character. Building costs
    O(total length of the strings) (about a second for 64 strings of 1024 characters in CPython), so
    build through :func:`stop_matcher`, which keeps recent automata: the server builds a request's
    before it reaches the scheduler thread. :meth:`fresh` gives a matcher of the same automaton at
    the start of the text.
    """

    def __init__(self, stops):
        self.goto: list[dict[str, int]] = [{}]
        self.depth_of = [0]
        self.fail = [0]
        self.out: list[str | None] = [None]  # the longest stop string ending at this state
        self.out_link = [0]  # next state (via failure links) with a match; 0 = none
        for w in stops:
            st = 0
            for ch in w:
                nxt = self.goto[st].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[st][ch] = nxt
                    self.goto.append({})
                    self.depth_of.append(self.depth_of[st] + 1)
                    self.fail.append(0)
                    self.out.append(None)
                    self.out_link.append(0)
                st = nxt
            if self.out[st] is None:
                self.out[st] = w
        order = list(self.goto[0].values())
        head = 0
        while head < len(order):  # breadth first: failure links point to shallower states
            st = order[head]
            head += 1
            for ch, nxt in self.goto[st].items():
                f = self.fail[st]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                cand = self.goto[f].get(ch, 0) if st else 0
                self.fail[nxt] = cand if cand != nxt else 0
                fl = self.fail[nxt]
                self.out_link[nxt] = fl if self.out[fl] is not None else self.out_link[fl]
                order.append(nxt)
        self.state = 0

    def fresh(self) -> "StopStrings":
        """A matcher sharing this automaton (read only), at the start of a text."""
        m = object.__new__(StopStrings)
        m.__dict__.update(self.__dict__)
        m.state = 0
        return m

    @property
    def depth(self) -> int:
        """Characters at the end of the text fed so far that may start a stop string."""
        return self.depth_of[self.state]

    def feed(self, ch: str) -> list[str]:
        """Advance by one character; returns the stop strings that end at it (longest first)."""
        st = self.state
        while st and ch not in self.goto[st]:
            st = self.fail[st]
        st = self.goto[st].get(ch, 0)
        self.state = st
        found = []
        m = st if self.out[st] is not None else self.out_link[st]
        while m:
            found.append(self.out[m])
            m = self.out_link[m]
        return found


@functools.lru_cache(maxsize=32)
def stop_matcher(stops: tuple[str, ...]) -> StopStrings:
    """The (shared, cached) automaton for ``stops``; use ``.fresh()`` for a matcher."""
    return StopStrings(stops)


class StopChecker:
    """Token-by-token stop conditions: stop ids, stop strings (held back while they may still
    match), max tokens. ``add`` returns the text that is safe to show.

    Stop strings are matched by :class:`StopStrings`, so checking a token costs what its characters
    cost, not the number or length of the stop strings. When a token's text completes several stop
    strings, the one that starts first wins (the output ends before it); :attr:`word` names it.
    """

    def __init__(self, tok: GemmaTokenizer, params: SamplingParams):
        self.tok, self.params = tok, params
        self.decoder = IncrementalDecoder(tok)
        self.text = ""  # all decoded text
        self.shown = 0  # chars of text already returned
        self.tokens: list[int] = []
        self.reason = ""
        self.word = ""  # the stop string that ended generation
        self.matcher = stop_matcher(tuple(params.stop)).fresh() if params.stop else None

    def add(self, token: int) -> str | None:
        """Feed one generated token; returns text to show, or None when the token is a stop token."""
        if token in self.tok.stop_ids and not self.params.ignore_eos:
            self.reason = "eos"
            return None
        self.tokens.append(token)
        new = self.decoder.push([token])
        start = len(self.text)
        self.text += new
        out_end = len(self.text)
        if self.matcher is not None:
            best = None
            for j, ch in enumerate(new):
                for w in self.matcher.feed(ch):
                    at = start + j + 1 - len(w)
                    if best is None or at < best[0]:
                        best = (at, w)
            if best is not None:
                self.reason, self.word = "stop", best[1]
                out_end = max(best[0], 0)
                self.text = self.text[:out_end]
            else:
                out_end -= self.matcher.depth  # a tail that could be the start of a stop string
        if self.reason != "stop" and self.params.max_tokens != -1 and len(self.tokens) >= self.params.max_tokens:
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
