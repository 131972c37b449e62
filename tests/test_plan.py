"""Where the drafter is chosen (``speculative/plan.py``): what a ``SpecConfig`` means for a target, decided
without loading weights, the same for every front end; and ``SpecConfig.checked``, the one check."""

import math

import pytest

from gemmaspec.errors import InputError
from gemmaspec.manage.shipped import shipped_assistant_entry
from gemmaspec.speculative.config import SpecConfig
from gemmaspec.speculative.plan import plan


@pytest.fixture(scope="module")
def shipped(model_path):
    entry = shipped_assistant_entry(model_path)
    assert entry is not None
    return entry


@pytest.fixture
def other_target(tmp_path):
    """A file no assistant is shipped for (plan reads no weights of the target: its size and hash)."""
    p = tmp_path / "other.gguf"
    p.write_bytes(b"GGUF" + bytes(64))
    return p


def test_unset_and_default_are_the_shipped_default_for_the_default_model(model_path, shipped):
    for spec in (SpecConfig(), SpecConfig(type="default")):
        pl = plan(spec, model_path)
        assert pl.spec_type == shipped["default_spec"] == "ngram-simple,draft-mtp"
        assert pl.draft_file == shipped["path"] and pl.shipped and pl.p_min == shipped["p_min"] == 0.3
        assert pl.model_type == "draft-mtp" and pl.why
    assert plan(SpecConfig(), None) == plan(SpecConfig(), model_path)  # None: the default model


def test_unset_on_a_target_without_a_shipped_assistant_is_ngram(other_target):
    for spec in (SpecConfig(), SpecConfig(type="default")):
        pl = plan(spec, other_target)
        assert (pl.spec_type, pl.draft_file, pl.p_min, pl.shipped) == ("ngram-simple", None, 0.0, False)
    assert plan(SpecConfig(type="none"), other_target).line() == "speculation: off"


def test_md_alone_drafts_by_the_files_role(model_path, shipped):
    assert plan(SpecConfig(draft_model=str(model_path)), model_path).spec_type == "draft-simple"
    pl = plan(SpecConfig(draft_model=shipped["path"]), model_path)
    assert pl.spec_type == "draft-mtp" and pl.shipped and pl.p_min == 0.3  # the shipped file, named by -md


def test_draft_mtp_finds_the_shipped_assistant_or_says_what_it_needs(model_path, shipped, other_target):
    pl = plan(SpecConfig(type="draft-mtp"), model_path)
    assert pl.draft_file == shipped["path"] and pl.p_min == 0.3
    with pytest.raises(InputError, match="needs the target's assistant: -md"):
        plan(SpecConfig(type="ngram-simple,draft-mtp"), other_target)
    with pytest.raises(InputError, match="needs a draft model: -md"):
        plan(SpecConfig(type="draft-simple"), model_path)


def test_p_min_the_flag_wins_and_another_assistant_gets_zero(model_path, shipped, other_target):
    assert plan(SpecConfig(type="draft-mtp", p_min=0.0), model_path).p_min == 0.0
    assert plan(SpecConfig(type="draft-mtp", p_min=0.7), model_path).p_min == 0.7
    # the shipped file drafting for a target it was not shipped for: not "shipped", no measured p-min
    pl = plan(SpecConfig(type="draft-mtp", draft_model=shipped["path"]), other_target)
    assert not pl.shipped and pl.p_min == 0.0
    assert plan(SpecConfig(type="draft-simple", draft_model=str(model_path)), model_path).p_min == 0.0


def test_the_line_says_type_n_max_and_file(model_path):
    line = plan(SpecConfig(n_max=2), model_path).line()
    assert line == ("speculation: ngram-simple,draft-mtp, n-max 2, with the assistant shipped for this model "
                    "(gemma-3-270m-assistant-q4_0.gguf, p-min 0.3)")


@pytest.mark.parametrize("spec, message", [
    (SpecConfig(type="bogus"), "--spec-type must be one of"),
    (SpecConfig(type="none,draft-mtp"), "cannot be combined"),
    (SpecConfig(type="ngram-simple", draft_model="x.gguf"), "-md is used by"),
    (SpecConfig(type="default", draft_model="x.gguf"), "-md is used by"),
    (SpecConfig(p_min=math.nan), r"p-min must be in \[0, 1\]"),
    (SpecConfig(p_min=1.5), r"p-min must be in \[0, 1\]"),
    (SpecConfig(n_min=-1), "n-min must be >= 0"),
    (SpecConfig(n_max="lots"), "n-max must be a number"),
    (SpecConfig(ngram_size=2, ngram_min=3), "n-gram sizes"),
])
def test_checked_refuses_bad_settings_with_their_names(spec, message):
    with pytest.raises(InputError, match=message):
        spec.checked()


def test_checked_spells_canonically():
    spec = SpecConfig(type="draft-mtp+ngram-simple", n_max="200").checked()
    assert spec.type == "ngram-simple,draft-mtp" and spec.n_max == 15  # llama.cpp's order; capped at 15
    assert SpecConfig(n_max="auto").checked().n_max == "auto"
