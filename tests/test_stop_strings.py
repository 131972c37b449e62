"""The stop-string matcher (streaming.StopStrings): the same answers as a plain search, and a long
stop list costs nothing up front (issue 13: a request with a huge stop list must not slow the
other slots; building its whole automaton took ~0.1-0.2 s of pure Python per request, and a flood
of such requests slowed another slot's stream by half or more)."""

from __future__ import annotations

import random
import string

from gemmaspec.streaming import StopStrings


def _plain(stops, text):
    found = sorted({w for w in stops if w and text.endswith(w)}, key=len, reverse=True)
    depth = max([k for k in range(1, len(text) + 1) if any(w.startswith(text[-k:]) for w in stops)] or [0])
    return found, depth


def test_matches_and_holds_back_as_a_plain_search():
    rnd = random.Random(13)
    for trial in range(300):
        alpha = "ab" if trial % 2 else "abc"
        stops = tuple("".join(rnd.choice(alpha) for _ in range(rnd.randint(1, 6))) for _ in range(rnd.randint(1, 8)))
        m, text = StopStrings(stops).fresh(), ""
        for _ in range(50):
            ch = rnd.choice(alpha)
            text += ch
            got = m.feed(ch)
            assert (got, m.depth) == _plain(stops, text), (stops, text)


def test_deep_overlapping_strings_need_no_recursion():
    stops = ("a" * 1024, "a" * 1023 + "b") + tuple("a" * k + "c" for k in range(0, 1000, 37))
    m = StopStrings(stops).fresh()
    for ch in "a" * 3000:
        assert m.feed(ch) == (["a" * 1024] if m.depth == 1024 else [])
    assert m.feed("b") == ["a" * 1023 + "b"] and m.depth == 1024


def test_a_long_stop_list_costs_what_the_text_visits():
    rnd = random.Random(1)
    stops = tuple("".join(rnd.choice(string.ascii_letters) for _ in range(1024)) for _ in range(64))
    m = StopStrings(stops)
    assert len(m.goto) == 1  # nothing built but the sorted list
    m = m.fresh()
    text = "".join(rnd.choice(string.ascii_letters + " ") for _ in range(500)) + stops[5]
    hits = [w for ch in text for w in m.feed(ch)]
    assert hits == [stops[5]]
    assert len(m.goto) <= len(text) + 1  # at most one new state per character fed
