"""``gemmaspec generate --compare`` (what ``make run`` shows): the prompt decoded plainly, then with the
default speculation, both speeds, the speedup, and whether the two texts are identical."""

import json
from types import SimpleNamespace

import pytest

from conftest import run_cli
from gemmaspec.cli import compare
from gemmaspec.sampling import SamplingParams

PROMPT = ('{"users": [\n  {"id": 1, "name": "Alice", "email": "alice@example.com", "role": "admin"},\n'
          '  {"id": 2, "name": "Bob", "email": "bob@example.com", "role": "user"},\n')


@pytest.mark.parametrize("sampling", [["--temp", "0"], ["--temp", "0.9", "--seed", "11"]])
def test_compare_shows_both_speeds_and_identical_texts(model_path, sampling):
    """Greedy, and sampled with one seed (drafts are one-hot and each position draws from its own seeded
    stream): the speculative text equals plain decoding's, token for token, and equals what
    ``--spec-type none`` prints on its own."""
    base = ("generate", "-m", str(model_path), "-p", PROMPT, "-n", "24", *sampling)
    res = run_cli(*base, "--compare", "--json")
    assert res.returncode == 0, res.stderr
    text, last = res.stdout.rstrip("\n").rsplit("\n", 1)
    rec = json.loads(last)
    assert rec["identical"] is True and rec["spec_type"] == "ngram-simple,draft-mtp" and rec["drafted"] > 0
    assert rec["plain"]["spec_type"] == "none" and rec["plain"]["drafted"] == 0
    assert rec["generated_tokens"] == rec["plain"]["generated_tokens"] == 24
    assert rec["seed"] == rec["plain"]["seed"]
    assert rec["speedup"] == pytest.approx(rec["decode_tps"] / rec["plain"]["decode_tps"], rel=1e-3)
    alone = run_cli(*base, "--spec-type", "none")
    assert alone.returncode == 0 and text + "\n" == alone.stdout
    err = res.stderr.splitlines()
    assert any(ln.startswith("plain       | ") and "decode" in ln for ln in err), res.stderr
    assert any(ln.startswith("speculative | ") and "decode" in ln for ln in err), res.stderr
    assert err[-1].startswith("speedup ") and "the two texts are identical (24 tokens" in err[-1], err[-1]


def test_compare_refuses_spec_type_none(model_path):
    res = run_cli("generate", "-m", str(model_path), "-p", "x", "--compare", "--spec-type", "none")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and "--compare" in lines[0] and "drop --spec-type none" in lines[0]


def test_first_difference():
    assert compare.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert compare.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert compare.first_difference([1, 2], [1, 2, 3]) == 2
    assert compare.first_difference([], []) is None


class _Engine:
    """Stands in for the engine: the drafted run writes ``spec_tokens`` in half the plain run's time."""

    def __init__(self, spec_tokens):
        self.spec_tokens = spec_tokens

    def generate(self, ids, params, drafter=None, stats=None, **kw):
        toks = ([5, 6, 7, 8] if drafter is None else self.spec_tokens)[:params.max_tokens]
        stats.generated_tokens, stats.seed = len(toks), params.seed
        stats.decode_ms = 30.0 if drafter is None else 15.0
        for t in toks:
            yield SimpleNamespace(text=f"<{t}>", tokens=[t])


@pytest.mark.parametrize("spec_tokens,code,verdict", [
    ([5, 6, 7, 8], 0, "the two texts are identical (4 tokens"),
    ([5, 6, 9, 8], 1, "the texts DIFFER from token 2"),
])
def test_the_verdict_and_exit_status(capsys, spec_tokens, code, verdict):
    plan = SimpleNamespace(spec=SimpleNamespace(n_max=3, n_min=0), spec_type="ngram-simple")
    args = SimpleNamespace(context_shift=False, keep=0, json=False)
    params = SamplingParams(temperature=0, max_tokens=4)
    assert compare.run(args, _Engine(spec_tokens), object(), plan, 0.5, [2, 3], params) == code
    out = capsys.readouterr()
    assert out.out == "".join(f"<{t}>" for t in spec_tokens) + "\n"  # the speculative text, not the plain one
    last = out.err.strip().splitlines()[-1]
    assert last.startswith("speedup 2.00x in decode tokens/s with ngram-simple, n-max 3;") and verdict in last, last
