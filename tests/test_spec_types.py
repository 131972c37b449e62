"""``--spec-type`` lists (llama.cpp's comma-separated types): parsing and the chain's precedence."""

import pytest

from gemmaspec.errors import InputError
from gemmaspec.speculative.drafters import ChainDrafter, Draft, DraftContext, NgramDrafter
from gemmaspec.speculative.options import parse_spec_type, spec_model_type, spec_parts
from gemmaspec.speculative.stats import SpecStats


@pytest.mark.parametrize("given, canonical", [
    ("ngram-simple", "ngram-simple"), ("draft-mtp", "draft-mtp"), ("none", "none"), ("default", "default"),
    ("draft-mtp,ngram-simple", "ngram-simple,draft-mtp"), ("ngram-simple,draft-mtp", "ngram-simple,draft-mtp"),
    (" draft-simple , ngram-simple ", "ngram-simple,draft-simple"), ("ngram-simple+draft-mtp", "ngram-simple,draft-mtp"),
    ("ngram-simple,ngram-simple", "ngram-simple"), (None, None),
])
def test_spec_type_lists_take_llama_cpp_order(given, canonical):
    assert parse_spec_type(given) == canonical


@pytest.mark.parametrize("bad, says", [
    ("eagle", "must be one of"), ("", "must be one of"), ("draft-mtp,draft-simple", "one model type"),
    ("none,ngram-simple", "cannot be combined"), ("default,draft-mtp", "cannot be combined"),
])
def test_bad_spec_type_lists_are_refused(bad, says):
    with pytest.raises(InputError, match=says):
        parse_spec_type(bad)


def test_parts_and_model_type():
    assert spec_parts("ngram-simple,draft-mtp") == ["ngram-simple", "draft-mtp"]
    assert spec_model_type("ngram-simple,draft-mtp") == "draft-mtp"
    assert spec_model_type("ngram-simple") is None and spec_parts(None) == []


class _Fixed:
    def __init__(self, name, tokens):
        self.name, self.tokens, self.calls = name, tokens, 0

    def reset(self):
        self.calls = 0

    def propose(self, ctx, n_max):
        self.calls += 1
        return Draft(list(self.tokens[:n_max]))


def test_the_first_drafter_that_proposes_wins():
    a, b = _Fixed("a", []), _Fixed("b", [5, 6, 7])
    chain = ChainDrafter([a, b])
    d = chain.propose(DraftContext([1, 2, 3]), 2)
    assert d.tokens == [5, 6] and d.source == "b" and a.calls == 1 and b.calls == 1
    a.tokens = [9]
    d = chain.propose(DraftContext([1, 2, 3]), 2)
    assert d.tokens == [9] and d.source == "a" and b.calls == 1  # b is not asked once a proposed
    a.tokens = []
    b.tokens = []
    assert chain.propose(DraftContext([1]), 3).tokens == [] and chain.name == "a,b"


def test_ngram_first_copies_and_leaves_the_rest_to_the_next():
    chain = ChainDrafter([NgramDrafter(4, 2), _Fixed("m", [42])])
    assert chain.propose(DraftContext([1, 2, 3, 4, 1, 2]), 2).tokens == [3, 4]  # "1 2" was followed by "3 4"
    d = chain.propose(DraftContext([7, 8, 9]), 2)
    assert (d.tokens, d.source) == ([42], "m")


def test_stats_per_drafter_add_up_and_merge():
    st = SpecStats()
    st.record(3, 2, "ngram-simple")
    st.record(1, 1, "draft-mtp")
    st.record(0, 0, "")
    st.record(2, 0, "draft-mtp")
    assert (st.drafted, st.accepted, st.steps, st.rounds) == (6, 3, 3, 4)
    assert st.by_drafter["draft-mtp"].drafted == 3 and st.by_drafter["ngram-simple"].accepted == 2
    other = SpecStats()
    other.record(4, 4, "ngram-simple")
    st.merge(other)
    assert st.by_drafter["ngram-simple"].drafted == 7
    lines = st.drafter_lines()
    assert lines[0].startswith("statistics ngram-simple: #gen drafts = 2, #gen tokens = 7, #acc tokens = 6")
    assert st.to_dict()["by_drafter"]["draft-mtp"]["draft_n"] == 3
    assert "by_drafter" not in SpecStats().to_dict()


def test_per_drafter_lines_follow_the_list_order():
    """The assistant drafted first (n-gram lookup had no match yet), n-gram later: the lines and
    ``by_drafter`` still list ngram-simple first, as the list drafts (they followed first use)."""
    st = SpecStats()
    st.record(2, 1, "draft-mtp")
    st.record(3, 3, "ngram-simple")
    assert [ln.split(":")[0] for ln in st.drafter_lines()] == ["statistics ngram-simple", "statistics draft-mtp"]
    assert list(st.to_dict()["by_drafter"]) == ["ngram-simple", "draft-mtp"]


def test_the_default_server_says_which_assistant_and_p_min_it_drafts_with(server):
    """``gemmaspec serve`` with no flags drafts with the list and the assistant shipped for the default
    model at its p-min: ``/props`` names that file (``draft_model`` was null: no ``-md`` was given) and
    p-min, and the startup log line says the p-min beside n_max."""
    import httpx

    from gemmaspec.manage.default_model import default_model_path
    from gemmaspec.manage.shipped import shipped_assistant

    sp = httpx.get(server.url + "/props", timeout=30).json()["speculative"]
    assert sp["type"] == "ngram-simple,draft-mtp" and sp["p_min"] == 0.3
    assert sp["draft_model"] == shipped_assistant(default_model_path())
    assert "speculative ngram-simple,draft-mtp (n_max 8, p_min 0.3), each round's draft length chosen" in server.log_path.read_text()


def test_the_memory_estimate_counts_the_assistant_serve_drafts_with_by_default(model_path):
    """``gemmaspec serve`` with no ``--spec-type`` and no ``-md`` drafts with the shipped assistant: the
    estimate counts its weights, as for ``--spec-type default`` (it counted none)."""
    from gemmaspec.manage.fit import check_memory
    from gemmaspec.speculative.config import SpecConfig
    from gemmaspec.speculative.plan import plan

    est = {st: check_memory(str(model_path), plan(SpecConfig(st), model_path).draft_file, 512, "cpu").draft
           for st in (None, "default", "none")}
    assert est[None] == est["default"] > 0 and est["none"] == 0
