"""Sampling flags read as llama.cpp reads them: a top-k of 0 or below is off, ``--repeat-last-n -1``
is the whole context (below -1 a one-line error), on ``generate`` / ``chat`` and ``serve``."""

from __future__ import annotations

import pytest

from gemmaspec.cli import build_parser
from gemmaspec.cli.args import sampling_params as _sampling_params
from gemmaspec.errors import InputError


def _args(*flags):
    return build_parser().parse_args(["generate", "-p", "x", *flags])


def test_negative_top_k_is_off_and_repeat_last_n_minus_one_is_the_whole_context():
    p = _sampling_params(_args("--top-k", "-1", "--repeat-last-n", "-1"))
    assert p.top_k == 0 and p.repeat_last_n >= 1 << 31  # more than any context holds
    assert _sampling_params(_args("--repeat-last-n", "0")).repeat_last_n == 0
    with pytest.raises(InputError, match="--repeat-last-n must be >= 0"):
        _sampling_params(_args("--repeat-last-n", "-2"))


def test_serve_takes_a_negative_top_k(monkeypatch):
    """``serve --top-k -1`` was refused ("top-k must be >= 0"); llama-server runs with top-k off."""
    from gemmaspec.cli import serve as main
    from gemmaspec.server import api

    seen = {}

    def fake_run(cfg, *a, **k):  # stop before loading or listening: the config is what counts
        seen["cfg"] = cfg
        raise SystemExit(0)

    monkeypatch.setattr(api, "ServeConfig", lambda **kw: fake_run(kw))
    args = build_parser().parse_args(["serve", "--top-k", "-1"])
    with pytest.raises(SystemExit):
        main.serve(args)
    assert seen["cfg"]["defaults"].top_k == 0
