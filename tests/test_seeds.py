"""Seeds as llama.cpp reads them: any integer, wrapped to a uint32 (``--seed -2`` is 4294967294), on the
command line of ``generate`` and ``serve`` (the server's request field is tested in
test_server_fields.py)."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from gemmaspec.cli import build_parser
from gemmaspec.seeds import llama_seed


@pytest.mark.parametrize("given,read", [(0, 0), (7, 7), (-1, -1), (2**32 - 1, -1), (-2, 2**32 - 2),
                                        (2**32 + 5, 5), (-(2**63), 0), (2**64 - 1, -1), (-(2**40) + 3, 3)])
def test_llama_seed_wraps_to_32_bits(given, read):
    assert llama_seed(given) == read


@pytest.mark.parametrize("command", [["generate", "-p", "x"], ["serve"]])
def test_seed_flag_takes_any_integer(command):
    p = build_parser()
    assert p.parse_args([*command, "--seed", "-2"]).seed == 4294967294
    assert p.parse_args([*command, "-s", "4294967301"]).seed == 5
    assert p.parse_args([*command, "--seed=-1"]).seed == -1


def test_generate_with_a_negative_seed_samples_as_the_wrapped_one(model_path):
    """``--seed -2`` was refused ("seed must be >= 0, or -1"); llama-cli reads it with ``std::stoul``
    as 4294967294, and so does gemmaspec: the same text, and the record says the seed used."""
    base = ("generate", "-m", str(model_path), "-p", "Once upon a time", "-n", "8", "--temp", "1",
            "--top-k", "0", "--spec-type", "none", "--json")
    neg, wrapped = run_cli(*base, "--seed", "-2"), run_cli(*base, "--seed", "4294967294")
    assert neg.returncode == 0 and wrapped.returncode == 0, neg.stderr
    (text, rec), (text2, rec2) = (r.stdout.rstrip("\n").rsplit("\n", 1) for r in (neg, wrapped))
    assert text == text2 and json.loads(rec)["seed"] == json.loads(rec2)["seed"] == 4294967294
