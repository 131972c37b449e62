"""Generated tokens → the text a user sees, as it streams: incremental detokenisation that never
splits a multi-byte character, and llama.cpp's stop conditions (stop tokens, stop strings held back
while they may still match). Used by every request (:class:`gemmaspec.engine.RequestState`), which
decides the ``max_tokens`` limit itself and tells :meth:`StopChecker.add` which token is the last.
"""

from __future__ import annotations

import bisect
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
    string, i.e. what must be held back) is known after every character. Nothing is built up front
    but the sorted list of strings: a trie state is the range of strings sharing a prefix, made
    (by binary search) the first time the text reaches it, and its failure and output links are
    computed then and kept. So a request's long stop list (64 strings of 1024 characters) costs
    what its text visits, not a whole automaton of pure Python (~0.1-0.2 s) competing with the
    model for the CPU. :func:`stop_matcher` shares automata; :meth:`fresh` gives a matcher at the
    start of a text (matchers of one automaton share the states made so far; all are fed on one
    thread).
    """

    def __init__(self, stops):
        self.words = sorted(set(w for w in stops if w))
        self.span = [(0, len(self.words), 0)]  # per state: its strings words[lo:hi], prefix length
        self.goto: list[dict[str, int]] = [{}]  # transitions made so far (-1: none)
        self.depth_of = [0]
        self.parent = [0]
        self.char = [""]
        self.out: list[str | None] = [None]  # the stop string ending at this state
        self.fail: list[int | None] = [0]  # None: not computed yet
        self.out_link: list[int | None] = [0]  # next state (via failure links) with a match; 0 = none
        self.state = 0

    def _child(self, st: int, ch: str) -> int:
        """The trie state after ``st`` reads ``ch``, made on first use; -1 when there is none."""
        c = self.goto[st].get(ch)
        if c is not None:
            return c
        lo, hi, d = self.span[st]
        words = self.words
        prefix = words[lo][:d] + ch
        i = bisect.bisect_left(words, prefix, lo, hi)
        if i < hi and words[i].startswith(prefix):
            j = bisect.bisect_right(words, prefix, i, hi, key=lambda w: w[:d + 1])
            c = len(self.span)
            self.span.append((i, j, d + 1))
            self.goto.append({})
            self.depth_of.append(d + 1)
            self.parent.append(st)
            self.char.append(ch)
            self.out.append(words[i] if len(words[i]) == d + 1 else None)
            self.fail.append(None)
            self.out_link.append(None)
        else:
            c = -1
        self.goto[st][ch] = c
        return c

    def _fail(self, st: int) -> int:
        """The failure link of ``st`` (the state of its longest proper suffix), computed on demand
        with those it depends on (shallower states), without recursion."""
        fail = self.fail
        stack = [st]
        while stack:
            s = stack[-1]
            if fail[s] is not None:
                stack.pop()
                continue
            p = self.parent[s]
            if p == 0:
                fail[s] = 0
                stack.pop()
                continue
            f = fail[p]
            if f is None:
                stack.append(p)
                continue
            ch = self.char[s]
            while f and self._child(f, ch) < 0 and fail[f] is not None:
                f = fail[f]
            if f and self._child(f, ch) < 0:  # a link on the way is not computed yet
                stack.append(f)
                continue
            fail[s] = max(self._child(f, ch), 0)
            stack.pop()
        return fail[st]

    def _out_link(self, st: int) -> int:
        """The nearest state on ``st``'s failure chain where a stop string ends (0: none)."""
        link = self.out_link[st]
        if link is not None:
            return link
        chain, s = [], st
        while True:
            chain.append(s)
            f = self._fail(s)
            if f == 0 or self.out[f] is not None:
                link = f
                break
            if self.out_link[f] is not None:
                link = self.out_link[f]
                break
            s = f
        for c in chain:  # none of their failure states but the last holds a match: they share the link
            self.out_link[c] = link
        return link

    def fresh(self) -> "StopStrings":
        """A matcher sharing this automaton, at the start of a text."""
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
        while st and self._child(st, ch) < 0:
            st = self._fail(st)
        st = max(self._child(st, ch), 0)
        self.state = st
        found = []
        m = st if self.out[st] is not None else self._out_link(st)
        while m:
            found.append(self.out[m])
            m = self._out_link(m)
        return found


@functools.lru_cache(maxsize=32)
def stop_matcher(stops: tuple[str, ...]) -> StopStrings:
    """The (shared, cached) automaton for ``stops``; use ``.fresh()`` for a matcher."""
    return StopStrings(stops)


class StopChecker:
    """Token-by-token stop conditions: stop ids and stop strings (held back while they may still
    match). ``add`` returns the text that is safe to show. :attr:`reason` is ``eos`` or ``stop`` when
    one of them ended the text; the caller may set another (``length``, ``context``) before
    :meth:`finish`. ``params.max_tokens`` is not read: the caller says which token is the last.

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

    def add(self, token: int, last: bool = False) -> str | None:
        """Feed one generated token; returns text to show, or None when the token is a stop token.
        ``last``: no token follows (the caller's length limit), so nothing is held back for stop
        strings (unless one matched)."""
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
        if last and self.reason != "stop":
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
