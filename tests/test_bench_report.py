"""`gemmaspec bench`'s output for people: the noise rule and the crossover sentence built on it, the
plain-text header, the paragraphs that explain the figures, the plots' design (one panel per
drafter, distinct colours, values on bars, integer ticks, no one-point lines), and the --quick preset.
All from synthetic results: nothing is timed here."""

from __future__ import annotations

import pytest
from matplotlib.container import BarContainer
from matplotlib.text import Annotation

from gemmaspec.bench import analyze, plots
from gemmaspec.bench.report import header, markdown
from gemmaspec.bench.suite import load_suite
from gemmaspec.cli import build_parser
from gemmaspec.cli.bench import parse_settings

TOKENS = 20


def _phase(config, users, tps, repeat, kind="k", target="gemmaspec", spec=None):
    """A phase whose aggregate tokens/s is exactly ``tps`` (two requests of TOKENS tokens)."""
    reqs = [{"index": i, "completion_tokens": TOKENS, "ttft_s": 0.05, "decode_s": TOKENS / tps,
             "arrivals": [[0.05 + j / tps, 1] for j in range(TOKENS)], "spec": spec, "text": "x", "tokens": None,
             "kind": kind} for i in range(2)]
    return {"target": target, "config": config, "kind": kind, "users": users, "repeat": repeat,
            "wall_s": 2 * TOKENS / tps, "requests": reqs}


SPEC = {"draft_n": 9, "draft_n_accepted": 6, "verify_steps": 4, "drafted_per_pos": [4, 3, 2],
        "accepted_per_pos": [3, 2, 1]}


def _results(series: dict, users=(1,), kinds=("k",), configs=None):
    """``series``: ``{(config, users): [tps of repeat 0, 1, ...]}``, the same for every kind."""
    phases = [_phase(cfg, u, tps, rep, kind, spec=None if cfg == "none" else SPEC)
              for kind in kinds for (cfg, u), per_rep in series.items() for rep, tps in enumerate(per_rep)]
    cfgs = configs or list(dict.fromkeys(cfg for cfg, _ in series))
    return {"phases": phases, "machine": {"cpu": "Test CPU", "cores": 2, "loadavg_start": [0.5, 0.4, 0.3]},
            "settings": {"suite": "default", "kinds": list(kinds), "users": list(users), "repeats": 3,
                         "max_tokens": 64, "temp": 0.0, "n_max": [0, 3], "configs": cfgs, "prompts_per_kind": 2},
            "targets": [{"kind": "in-process", "name": "gemmaspec", "model": "/m/gemma.gguf", "model_sha256": "ab" * 32,
                         "drafts": {"draft-mtp": {"path": "/m/assistant.gguf", "sha256": "cd" * 32}},
                         "p_min": {"draft-mtp": 0.3}, "spec_types": ["ngram-simple", "draft-mtp"], "batched": True}],
            "versions": {"gemmaspec": "0.1.0", "torch": None}, "lossless": []}


# -- the noise rule --------------------------------------------------------------------------------------
def test_the_noise_rule_decides_on_band_and_spread():
    assert analyze.verdict(1.02) == "noise"                      # inside ±3%, whatever the spread
    assert analyze.verdict(0.975, [0.97, 0.98]) == "noise"
    assert analyze.verdict(1.05, [1.04, 1.06]) == "pays"         # outside the band, spread clear of 1.0
    assert analyze.verdict(1.05, [0.98, 1.12]) == "noise"        # the spread includes 1.0
    assert analyze.verdict(1.5, [1.4, 1.6]) == "pays" and analyze.verdict(0.8, [0.7, 0.9]) == "costs"
    assert analyze.verdict(None) is None


def test_a_1_02x_whose_repeats_straddle_1_is_within_noise():
    res = _results({("none", 1): [100, 100, 100], ("ngram-simple n=3", 1): [99, 102, 106]})
    s = analyze.summarize(res)
    c = next(c for c in s["cells"] if c["config"] == "ngram-simple n=3" and c["kind"] == "all")
    assert c["speedup_aggregate"] == pytest.approx(1.02)
    assert c["speedup_aggregate_range"] == pytest.approx([0.99, 1.06])  # min to max of the per-repeat ratios
    assert analyze.within_noise(c["speedup_aggregate"], c["speedup_aggregate_range"])
    sentence = analyze.crossover_sentence(s["crossover"]["gemmaspec"], "gemmaspec")
    assert "pays" not in sentence and "within noise at 1 user" in sentence
    md = markdown(res, s)
    assert "(~1.02x)" in md and "within noise" in md


def test_a_clear_speedup_pays_and_a_fading_one_stops_paying():
    res = _results({("none", 1): [100, 100, 100], ("ngram-simple n=3", 1): [150, 155, 148],
                    ("none", 2): [180, 180, 180], ("ngram-simple n=3", 2): [178, 184, 190]}, users=(1, 2))
    s = analyze.summarize(res)
    cross = s["crossover"]["gemmaspec"]["all"]
    assert cross["stops_at"] == 2 and [cross["best"][u][3] for u in (1, 2)] == ["pays", "noise"]
    sentence = analyze.crossover_sentence(s["crossover"]["gemmaspec"], "gemmaspec")
    assert "stops paying at 2 concurrent users over all kinds" in sentence
    assert "every count" not in sentence and "~1.02x at 2 users" in sentence and "1.50x at 1 user" in sentence
    one = _results({("none", 1): [100, 100, 100], ("ngram-simple n=3", 1): [150, 155, 148]})
    assert "pays at 1 user over all kinds" in markdown(one, analyze.summarize(one))


def test_one_repeat_has_no_spread_and_the_report_says_so():
    res = _results({("none", 1): [100], ("ngram-simple n=3", 1): [110]})
    res["settings"]["repeats"] = 1
    s = analyze.summarize(res)
    c = next(c for c in s["cells"] if c["config"] == "ngram-simple n=3" and c["kind"] == "all")
    assert c["speedup_aggregate_range"] == pytest.approx([1.1, 1.1])
    assert analyze.verdict(c["speedup_aggregate"], c["speedup_aggregate_range"]) == "pays"
    assert "one repeat, so there is no spread" in markdown(res, s)


# -- the report's text -------------------------------------------------------------------------------------
def test_the_header_is_plain_text():
    res = _results({("none", 1): [100, 100, 100], ("ngram-simple n=3", 1): [150, 150, 150]}, users=(1,))
    res["settings"]["users"] = [1, 2, 4]
    res["targets"].append({"kind": "url", "name": "server", "url": "http://127.0.0.1:1", "model": "fake",
                           "metrics": False, "models": ["fake", "other"],
                           "props": {"total_slots": 4, "speculative": {"type": "ngram-simple", "n_max": 3}}})
    text = "\n".join(header(res))
    for bad in ("{", "}", "[", "]", "'", "None", "True"):
        assert bad not in text, bad
    for want in ("Test CPU, 2 cores", "users 1, 2, 4", "3 repeats", "2 prompts per kind", "greedy",
                 "model: /m/gemma.gguf", "sha256: abababababababab...", "draft-mtp (path /m/assistant.gguf",
                 "p-min: draft-mtp 0.3", "batched forward: yes", "speculative (type ngram-simple, n_max 3)",
                 "served models: fake, other", "/metrics counters: no", "draft lengths 3"):
        assert want in text, want
    assert "{" not in markdown(res, analyze.summarize(res))


def test_the_report_explains_aggregate_against_per_user():
    res = _results({("none", 1): [100, 100, 100], ("ngram-simple n=3", 1): [150, 150, 150]})
    for ph in res["phases"]:  # per-user decode twice as fast as the aggregate says for the speculative runs
        if ph["config"] != "none":
            for r in ph["requests"]:
                r["decode_s"] /= 2
    s = analyze.summarize(res)
    md = markdown(res, s)
    assert "**Aggregate and per-user speedups differ.**" in md
    assert "ngram-simple n=3, gives 1.50x aggregate and 3.00x per user" in md


# -- the plots ---------------------------------------------------------------------------------------------
def _two_drafters(users=(1,)):
    series = {}
    for u in users:
        series[("none", u)] = [100 / u] * 3
        for n, gain in (("1", 1.2), ("2", 1.4), ("3", 1.3), ("auto", 1.5)):
            series[(f"ngram-simple n={n}", u)] = [100 * gain / u * f for f in (0.97, 1.0, 1.02)]
            series[(f"draft-mtp n={n}", u)] = [100 * (gain - 0.1) / u * f for f in (0.98, 1.0, 1.01)]
    return _results(series, users=users, kinds=("code", "qa", "story"))


def _series_colours(ax) -> list:
    bars = [tuple(c.patches[0].get_facecolor()) for c in ax.containers if isinstance(c, BarContainer)]
    lines = [tuple(__import__("matplotlib").colors.to_rgba(ln.get_color())) for ln in ax.get_lines()
             if not ln.get_label().startswith("_") and ln.get_gid() != plots.REFERENCE]
    return bars + lines


def _bar_count(ax) -> int:
    return sum(len(c.patches) for c in ax.containers if isinstance(c, BarContainer))


def test_the_speedup_plot_has_a_panel_per_drafter_with_labelled_bars():
    res = _two_drafters()
    s = analyze.summarize(res)
    fig = plots.speedup_figure(s, res)
    assert len(fig.axes) == 2
    assert [ax.get_title() for ax in fig.axes] == ["gemmaspec: ngram-simple (1 user)", "gemmaspec: draft-mtp (1 user)"]
    for ax in fig.axes:
        colours = _series_colours(ax)
        assert len(colours) == 4 and len(set(colours)) == 4  # n=1, 2, 3, auto: each its own colour
        assert _bar_count(ax) == 4 * 4  # 4 draft lengths x (all, code, qa, story)
        labels = [t.get_text() for t in ax.texts if isinstance(t, Annotation)]
        assert len(labels) == _bar_count(ax) and all(float(x) > 1.0 for x in labels)
        assert ax.get_ylim()[0] == 0
        assert any(ln.get_gid() == plots.REFERENCE and ln.get_ydata()[0] == 1.0 for ln in ax.get_lines())
        assert ax.get_legend() is not None and ax.get_legend().get_bbox_to_anchor().x0 > ax.bbox.x1 - 1
    mtp = fig.axes[1]
    auto = [c for c in mtp.containers if isinstance(c, BarContainer) and c.get_label() == "n=auto"][0]
    assert auto.errorbar is not None  # the spread over repeats drawn on the bars


def test_one_user_count_is_bars_not_a_one_point_line():
    res = _two_drafters(users=(1,))
    fig = plots.users_figure(analyze.summarize(res), res)
    assert len(fig.axes) == 2
    for ax in fig.axes:
        assert not [ln for ln in ax.get_lines() if len(ln.get_xdata()) == 1 and ln.get_linestyle() != "None"]
        assert _bar_count(ax) == 5  # none and 4 draft lengths
        assert len(set(_series_colours(ax))) == 5
        assert [t.get_text() for t in ax.get_xticklabels()] == ["none", "1", "2", "3", "auto"]
        assert len([t for t in ax.texts if isinstance(t, Annotation)]) == 5 and ax.get_ylim()[0] == 0


def test_users_are_lines_with_integer_ticks_from_zero():
    res = _two_drafters(users=(1, 2, 4))
    fig = plots.users_figure(analyze.summarize(res), res)
    assert len(fig.axes) == 2
    for ax in fig.axes:
        data = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_") and ln.get_gid() != plots.REFERENCE]
        assert len(data) == 5 and all(len(ln.get_xdata()) == 3 for ln in data)
        assert len(set(_series_colours(ax))) == 5
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4"]
        assert ax.get_ylim()[0] == 0 and ax.collections  # bands from the repeats


def test_acceptance_has_integer_positions_and_values():
    res = _two_drafters()
    fig = plots.acceptance_figure(analyze.summarize(res), res)
    assert len(fig.axes) == 2
    for ax in fig.axes:
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        assert ticks == ["1", "2", "3"] and all(float(t).is_integer() for t in ticks)
        labels = [t.get_text() for t in ax.texts if isinstance(t, Annotation)]
        assert labels and len(labels) == _bar_count(ax) and set(labels) == {"0.75", "0.67", "0.50"}
        assert len(set(_series_colours(ax))) == 4


def test_many_draft_lengths_still_get_distinct_colours():
    for n in (1, 5, 9, 10, 16):
        cols = [tuple(c) for c in plots.palette(n)]
        assert len(cols) == n and len(set(cols)) == n


# -- --quick ------------------------------------------------------------------------------------------------
def _settings(*argv):
    return parse_settings(build_parser().parse_args(["bench", *argv, "--out", "o"]))


def test_quick_selects_two_prompts_per_kind_one_repeat_one_user():
    s = _settings("--quick")
    assert (s["prompts_per_kind"], s["repeats"], s["users"], s["max_tokens"], s["quick"]) == (2, 1, [1], 64, True)
    prompts = load_suite(s["suite"], s["kinds"], s["prompts_per_kind"])
    every = load_suite("default")
    per_kind = {}
    for p in prompts:
        per_kind.setdefault(p.kind, []).append(p.index)
    assert set(per_kind) == {p.kind for p in every} and all(v == [0, 1] for v in per_kind.values())
    full = _settings()
    assert (full["prompts_per_kind"], full["repeats"], full["users"], full["max_tokens"]) == (
        None, 3, [1, 2, 4, 8], 128)
    mixed = _settings("--quick", "--users", "1,2", "--max-tokens", "16")  # an explicit flag wins over the preset
    assert (mixed["users"], mixed["max_tokens"], mixed["repeats"]) == ([1, 2], 16, 1)


def test_quick_is_in_the_help():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = sub.choices["bench"].format_help()
    assert "--quick" in text and "--prompts-per-kind 2 --repeats 1 --users 1 --max-tokens 64" in " ".join(text.split())
