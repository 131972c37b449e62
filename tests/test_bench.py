"""`gemmaspec bench`: suite parsing, figures and crossover from known data, a fake OpenAI-compatible
server (llama.cpp-style timings, vLLM-style /metrics, neither), interruption, and a tiny real run."""

from __future__ import annotations

import json
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gemmaspec.bench import analyze
from gemmaspec.bench.plots import PANEL_HEIGHT
from gemmaspec.bench.report import PLOT_DPI, PLOT_SIZE, PLOTS, write_report
from gemmaspec.bench.run import Config, sweep
from gemmaspec.bench.suite import load_suite
from gemmaspec.cli import main
from gemmaspec.errors import InputError


# -- the suite ----------------------------------------------------------------------------------------
def test_default_suite_has_ten_kinds_of_ten():
    prompts = load_suite("default")
    kinds = {}
    for p in prompts:
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
        assert (p.prompt is None) != (p.messages is None)
    assert len(kinds) >= 8 and min(kinds.values()) >= 10
    assert {"code", "rewrite", "json", "chat", "summarize", "translate", "qa", "math", "rag", "story"} <= set(kinds)
    assert all(p.messages for p in prompts if p.kind == "chat")


def _write(tmp_path, lines, name="s.jsonl"):
    f = tmp_path / name
    f.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return f


@pytest.mark.parametrize("bad, words", [
    ("{not json", "not valid JSON"),
    ({"prompt": "hi"}, "'kind'"),
    ({"kind": "a"}, "exactly one of"),
    ({"kind": "a", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "exactly one of"),
    ({"kind": "a", "messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
    ({"kind": "a", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"kind": "a", "prompt": "x", "temperature": 1}, "unknown field"),
    ([1, 2], "JSON object"),
])
def test_malformed_line_is_named(tmp_path, bad, words):
    f = _write(tmp_path, [{"kind": "a", "prompt": "ok"}, "", "# a comment", bad])
    with pytest.raises(InputError) as e:
        load_suite(f)
    assert f"{f}:4:" in str(e.value) and words in str(e.value)


def test_kinds_filter_and_unknown_kind(tmp_path):
    f = _write(tmp_path, [{"kind": "a", "prompt": "1"}, {"kind": "b", "prompt": "2"}, {"kind": "a", "prompt": "3"}])
    got = load_suite(f, kinds=["b", "a"], per_kind=1)
    assert [(p.kind, p.prompt, p.index, p.line) for p in got] == [("b", "2", 0, 2), ("a", "1", 0, 1)]
    with pytest.raises(InputError, match="unknown kind.*nope.*has a, b"):
        load_suite(f, kinds=["nope"])


def _one_line_error(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("error: ") and "\n" not in err, err
    return err


def test_cli_errors_are_one_line(tmp_path, capsys):
    f = _write(tmp_path, [{"kind": "a", "prompt": "ok"}, {"kind": "a", "prompt": ""}])
    assert f"{f}:2:" in _one_line_error(capsys, ["bench", "--suite", str(f), "--out", str(tmp_path / "o")])
    assert "unknown kind" in _one_line_error(capsys, ["bench", "--kinds", "nope", "--out", str(tmp_path / "o")])
    err = _one_line_error(capsys, ["bench", "--url", "http://127.0.0.1:1", "--out", str(tmp_path / "o")])
    assert "cannot reach http://127.0.0.1:1" in err
    assert "give -m/-md" in _one_line_error(capsys, ["bench", "--url", "http://x", "-m", "m.gguf", "--out", "o"])
    assert "--spec-type must name" in _one_line_error(capsys, ["bench", "--spec-type", "none", "--out", "o"])


def test_draft_type_without_its_file_is_one_line_error(tmp_path, capsys):
    err = _one_line_error(capsys, ["bench", "--spec-type", "draft-simple", "--kinds", "qa", "--out", str(tmp_path)])
    assert "--spec-type draft-simple needs a draft model as -md" in err


# -- figures from known data -------------------------------------------------------------------------
def _req(index, tokens, decode_s, ttft=0.1, spec=None, arrivals=None, text=None, ids=None):
    arr = arrivals or [[ttft + decode_s * i / max(1, tokens - 1), 1] for i in range(tokens)]
    return {"kind": "k", "index": index, "completion_tokens": tokens, "ttft_s": ttft, "decode_s": decode_s,
            "arrivals": arr, "spec": spec, "text": text if text is not None else "x" * tokens, "tokens": ids}


def _phase(config, users, wall, reqs, kind="k", repeat=0, target="gemmaspec"):
    return {"target": target, "config": config, "kind": kind, "users": users, "repeat": repeat, "wall_s": wall,
            "requests": [dict(r, kind=kind) for r in reqs]}


def _synthetic():
    """Baseline 10 tok/s aggregate at every user count; speculation 20, 15, 9 tok/s at 1, 2, 4 users
    (kind k), and for kind j 30 at 1 user but 8 at 2 users and 12 at 4 (a dip is not the crossover)."""
    spec = {"draft_n": 10, "draft_n_accepted": 6, "verify_steps": 5, "drafted_per_pos": [5, 5],
            "accepted_per_pos": [4, 2]}
    ph = []
    for u, wall_spec in ((1, 1.0), (2, 20 / 15), (4, 20 / 9)):
        ph.append(_phase("none", u, 2.0, [_req(0, 10, 1.0), _req(1, 10, 1.0)]))
        ph.append(_phase("ngram-simple n=2", u, wall_spec, [_req(0, 10, 0.5, spec=spec), _req(1, 10, 0.5, spec=spec)]))
    for u, wall_spec in ((1, 20 / 30), (2, 20 / 8), (4, 20 / 12)):
        ph.append(_phase("none", u, 2.0, [_req(0, 10, 1.0), _req(1, 10, 1.0)], kind="j"))
        ph.append(_phase("ngram-simple n=2", u, wall_spec, [_req(0, 10, 0.5, spec=spec), _req(1, 10, 0.5, spec=spec)],
                         kind="j"))
    return {"phases": ph, "settings": {"kinds": ["k", "j"], "users": [1, 2, 4]}, "machine": {}, "targets": [],
            "lossless": []}


def _cell(s, config, kind, users, target="gemmaspec"):
    return next(c for c in s["cells"] if (c["target"], c["config"], c["kind"], c["users"]) == (target, config, kind, users))


def test_figures_and_crossover_from_known_runs():
    s = analyze.summarize(_synthetic())
    c = _cell(s, "ngram-simple n=2", "k", 1)
    assert c["aggregate_tps"] == pytest.approx(20.0) and c["speedup_aggregate"] == pytest.approx(2.0)
    assert c["per_user_tps"] == pytest.approx(18.0) and c["speedup_per_user"] == pytest.approx(2.0)
    assert c["spec"]["acceptance_rate"] == pytest.approx(0.6)
    assert c["spec"]["mean_accepted_length"] == pytest.approx(1 + 12 / 10)
    assert c["spec"]["acceptance_per_pos"] == pytest.approx([0.8, 0.4])
    assert c["ttft_p50_ms"] == pytest.approx(100.0)
    assert _cell(s, "ngram-simple n=2", "k", 4)["speedup_aggregate"] == pytest.approx(0.9)
    # all kinds: total tokens / total wall time, per user count
    assert _cell(s, "ngram-simple n=2", "all", 2)["aggregate_tps"] == pytest.approx(40 / (20 / 15 + 20 / 8))
    assert _cell(s, "none", "all", 2)["speedup_aggregate"] == pytest.approx(1.0)
    cross = s["crossover"]["gemmaspec"]
    assert cross["k"]["stops_at"] == 4 and not cross["k"]["never_paid"]
    assert cross["j"]["stops_at"] is None  # 0.8x at 2 users, then 1.2x at 4: it still pays at the top
    sentence = analyze.crossover_sentence(cross, "gemmaspec")
    assert "stops paying at 4 concurrent users for k" in sentence
    assert "pays at every count measured (up to 4) for j" in sentence


def test_crossover_never_paid_and_no_baseline():
    cells = [{"target": "t", "kind": "k", "users": u, "config": "x", "speedup_aggregate": 0.7} for u in (1, 2)]
    cross = analyze.crossover(cells, "t")
    assert cross["k"]["stops_at"] == 1 and cross["k"]["never_paid"]
    assert "never paid" in analyze.crossover_sentence(cross, "t")
    none = analyze.crossover([{"target": "t", "kind": "k", "users": 1, "config": "x", "speedup_aggregate": None}], "t")
    assert "no crossover" in analyze.crossover_sentence(none, "t")


def test_where_speculation_stops_paying_the_chosen_lengths_are_judged_against_none():
    """Kind k stops paying at 4 users (the best fixed length 0.9x); there the lengths chosen per round
    gave 0.8x (outside noise: it lost) in one configuration and 0.99x (within noise) in another; kind j
    pays everywhere and is not named."""
    cells = [{"target": "t", "kind": kind, "users": u, "config": cfg, "speedup_aggregate": x}
             for kind, u, cfg, x in (("k", 1, "n=2", 2.0), ("k", 2, "n=2", 1.5), ("k", 4, "n=2", 0.9),
                                     ("k", 1, "d n=choose3", 1.9), ("k", 4, "d n=choose3", 0.8),
                                     ("k", 4, "m n=choose3", 0.99), ("j", 4, "n=2", 1.5),
                                     ("j", 4, "d n=choose3", 1.4))]
    cross = analyze.crossover(cells, "t")
    assert cross["k"]["stops_at"] == 4 and cross["j"]["stops_at"] is None
    said = analyze.chosen_where_it_stops(cells, cross, "t")
    assert "d n=choose3 gave 0.80x for k at 4 users: slower than no speculation outside noise for k at 4 users" in said
    assert "m n=choose3 gave ~0.99x for k at 4 users: never slower than no speculation outside noise" in said
    assert " j " not in said and "1.90x" not in said
    pays = [c for c in cells if c["kind"] == "j"]
    assert analyze.chosen_where_it_stops(pays, analyze.crossover(pays, "t"), "t") == ""


def test_itl_merges_a_round_and_splits_its_gap():
    # a token at 0.1; then 3 in one round, its last piece at 0.4005 (when the reader has it all); 1 at 0.5
    assert analyze.itl_samples([[0.1, 1], [0.4, 2], [0.4005, 1], [0.5, 1]]) == pytest.approx(
        [0.3005 / 3] * 3 + [0.0995])


def test_lossless_finds_first_difference():
    res = {"phases": [_phase("none", 1, 1, [_req(0, 3, 1, ids=[1, 2, 3], text="abc")]),
                      _phase("n=2", 1, 1, [_req(0, 3, 1, ids=[1, 2, 9], text="abz")]),
                      _phase("n=2", 2, 1, [_req(0, 3, 1, ids=[1, 2, 3], text="abc")])]}
    got = analyze.lossless(res, margin=lambda t, k, i, prefix: float(len(prefix)))
    assert [(m["config"], m["users"], m["position"], m["unit"], m["top2_margin"], m["got"], m["expected"])
            for m in got] == [("n=2", 1, 2, "token", 2.0, 9, 3)]
    assert analyze.first_difference([1, 2], [1, 2, 3]) == 2 and analyze.first_difference("ab", "ab") is None


def test_report_and_plots_from_synthetic_results(tmp_path):
    import matplotlib.image

    res = _synthetic()
    res["lossless"] = [{"target": "gemmaspec", "config": "ngram-simple n=2", "users": 1, "kind": "k", "index": 0,
                        "position": 5, "unit": "token", "count": 1, "got": 7, "expected": 8, "top2_margin": 0.01}]
    write_report(tmp_path, res)
    md = (tmp_path / "report.md").read_text()
    assert "stops paying at 4 concurrent users for k" in md
    assert "20.0 (2.00x)" in md  # kind k, 1 user
    assert "| gemmaspec | ngram-simple n=2 | 1 | k | 0 | token 5 | 7 / 8 | 0.0100 | 1 |" in md
    for name in PLOTS:
        img = matplotlib.image.imread(tmp_path / name)
        assert img.shape[:2] == (round(PLOT_SIZE[1] * PLOT_DPI), round(PLOT_SIZE[0] * PLOT_DPI))


# -- a fake OpenAI-compatible server ---------------------------------------------------------------------
class FakeServer:
    """Streams ``max_tokens`` one-token chunks ``t0 t1 ...``; with ``speculative.n_max`` N > 0 each
    request counts ``draft = 2N``, ``accepted = N`` (N verify steps; position i accepted N - i... capped
    to the first two positions: [N, 0]). ``style``: ``llama`` (``timings`` in the final chunk),
    ``vllm`` (``vllm:`` counters in /metrics, no timings) or ``none`` (neither). ``flip``: prompts
    containing it get their 3rd character changed when N > 0 (a planted mismatch)."""

    def __init__(self, style: str, flip: str | None = None):
        self.style, self.flip = style, flip
        self.counts = {"draft": 0, "accepted": 0, "steps": 0, "pos0": 0}
        self.seen = []
        lock = threading.Lock()
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body, ctype="application/json"):
                data = body.encode() if isinstance(body, str) else body
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._send(200, json.dumps({"data": [{"id": "fake-model"}]}))
                if self.path == "/metrics" and fake.style == "vllm":
                    c = fake.counts
                    return self._send(200, "# TYPE x counter\n"
                                      f"vllm:spec_decode_num_draft_tokens_total{{model=\"m\"}} {c['draft']}\n"
                                      f"vllm:spec_decode_num_accepted_tokens_total{{model=\"m\"}} {c['accepted']}\n"
                                      f"vllm:spec_decode_num_drafts_total{{model=\"m\"}} {c['steps']}\n"
                                      f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position=\"0\"}} {c['pos0']}\n"
                                      "vllm:num_requests_running 0\n", "text/plain")
                return self._send(404, "{}")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                n, k = body["max_tokens"], body.get("speculative.n_max", 0)
                k = 3 if k == "auto" else k
                text = body.get("prompt") or body["messages"][-1]["content"]
                with lock:
                    fake.seen.append((self.path, k, body.get("model"), body.get("ignore_eos")))
                    if k and fake.style == "vllm":
                        fake.counts["draft"] += 2 * k
                        fake.counts["accepted"] += k
                        fake.counts["steps"] += k
                        fake.counts["pos0"] += k
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                chat = "chat" in self.path
                for i in range(n):
                    piece = f"t{i} "
                    if i == 1 and k and fake.flip and fake.flip in text:
                        piece = "tX "
                    ch = {"delta": {"content": piece}} if chat else {"text": piece}
                    self.wfile.write(f"data: {json.dumps({'choices': [ch]})}\n\n".encode())
                final = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}}
                if fake.style == "llama":
                    final["timings"] = {"draft_n": 2 * k, "draft_n_accepted": k}
                self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def small_suite(tmp_path):
    return _write(tmp_path, [{"kind": "a", "prompt": "alpha FLIP"}, {"kind": "a", "prompt": "beta", "max_tokens": 4},
                             {"kind": "c", "messages": [{"role": "user", "content": "hi"}]}], "suite.jsonl")


@pytest.mark.parametrize("style", ["llama", "vllm", "none"])
def test_url_mode_against_a_fake_server(tmp_path, capsys, small_suite, style):
    srv = FakeServer(style, flip="FLIP")
    out = tmp_path / "out"
    try:
        rc = main(["bench", "--url", srv.url + "/v1", "--suite", str(small_suite), "--spec-draft-n-max", "2,auto",
                   "--users", "1,2", "--repeats", "2", "--max-tokens", "6", "--out", str(out), "--no-progress"])
    finally:
        srv.close()
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    assert res["complete"] and not res["interrupted"]
    assert res["targets"][0]["model"] == "fake-model" and res["targets"][0]["metrics"] == (style == "vllm")
    assert len(res["phases"]) == 2 * 2 * 3 * 2  # repeats x kinds x users x configs
    assert {p[0] for p in srv.seen} == {"/v1/completions", "/v1/chat/completions"}
    assert {p[1] for p in srv.seen} == {0, 2, 3} and all(p[2] == "fake-model" and p[3] for p in srv.seen)
    for ph in res["phases"]:
        n_req = {("a", 1): 2, ("a", 2): 2, ("c", 1): 1, ("c", 2): 2}[(ph["kind"], ph["users"])]
        assert len(ph["requests"]) == n_req
        for r in ph["requests"]:
            assert r["completion_tokens"] == (4 if (ph["kind"], r["index"]) == ("a", 1) else 6)
    s = res["summary"]  # the figures as results.json holds them
    assert s == json.loads(json.dumps(analyze.summarize(res)))
    for c in s["cells"]:
        toks = sum(r["completion_tokens"] for ph in res["phases"] if _in(ph, c) for r in ph["requests"])
        assert c["completion_tokens"] == toks
        if c["config"] == "none" or style == "none":
            assert c["spec"] is None or not c["spec"]["draft_n"]
        else:
            assert c["spec"]["acceptance_rate"] == pytest.approx(0.5)
            if style == "vllm":
                assert c["spec"]["mean_accepted_length"] == pytest.approx(2.0)
                assert c["spec"]["acceptance_per_pos"] == pytest.approx([1.0])
        base = _cell(s, "none", c["kind"], c["users"], "server")
        assert c["speedup_aggregate"] == pytest.approx(c["aggregate_tps"] / base["aggregate_tps"])
    for kind, cr in s["crossover"]["server"].items():  # the crossover follows from the stored speedups
        best, spread = {}, {}
        for c in s["cells"]:
            if c["kind"] == kind and c["config"] != "none" and c["speedup_aggregate"] > best.get(c["users"], 0):
                best[c["users"]], spread[c["users"]] = c["speedup_aggregate"], c["speedup_aggregate_range"]
        assert {int(u): b[1] for u, b in cr["best"].items()} == pytest.approx(best)
        # paying: above 1 by more than 3% and every repeat's ratio above 1 (outside noise)
        pays = [u for u in sorted(best) if best[u] > 1.03 and spread[u][0] > 1.0]
        assert cr["stops_at"] == (None if pays and pays[-1] == max(best) else
                                  min(u for u in best if not pays or u > pays[-1]))
    per_rep = {}
    for ph in res["phases"]:
        if (ph["config"], ph["kind"], ph["users"]) == ("server n=2", "a", 2):
            per_rep[ph["repeat"]] = sum(r["completion_tokens"] for r in ph["requests"]) / ph["wall_s"]
    assert _cell(s, "server n=2", "a", 2, "server")["aggregate_tps"] == pytest.approx(
        statistics.median(per_rep.values()))
    mism = res["lossless"]
    assert {(m["kind"], m["index"], m["position"], m["unit"], m["got"], m["expected"]) for m in mism} == {
        ("a", 0, 4, "char", "X", "1")}
    assert {m["config"] for m in mism} == {"server n=2", "server n=auto"}
    md = (out / "report.md").read_text()
    assert "## Crossover" in md and "Lossless check" in md
    if style == "none":
        assert "reported no acceptance" in md


def _in(ph, c):
    return (ph["target"], ph["config"], ph["users"]) == (c["target"], c["config"], c["users"]) and \
        c["kind"] in (ph["kind"], "all")


# -- interruption ------------------------------------------------------------------------------------------
class _InterruptingTarget:
    """Answers instantly; on its ``at``-th request it interrupts the main thread (as Ctrl-C does)."""

    name = "fake"

    def __init__(self, at):
        self.calls, self.at = 0, at

    def request(self, p, spec_type, n_max, max_tokens, temp, seed, stop=None):
        import _thread

        self.calls += 1
        if self.calls == self.at:
            _thread.interrupt_main()
            if stop is not None:  # as a real request would, keep going until the main thread has seen it
                stop.wait(10)
        return {"tokens": [1] * max_tokens, "text": "a" * max_tokens, "completion_tokens": max_tokens,
                "prompt_tokens": 3, "ttft_s": 0.01, "decode_s": 0.01, "arrivals": [[0.01, max_tokens]], "spec": None}

    def counters(self):
        return None

    def describe(self):
        return {"name": self.name}


def test_interrupted_run_keeps_valid_partial_results(tmp_path, small_suite):
    import signal

    prompts = load_suite(small_suite)
    target = _InterruptingTarget(at=4)
    # interrupt_main() does nothing while SIGINT is ignored or at its default, which an earlier test in
    # the same process (a server's signal handling) may have left: Python's own handler for this test
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        res = sweep(tmp_path, prompts, [1], [Config("x", 0), Config("x", 2)], [target], 1, 5, 0.0, 0, {},
                    progress=False)
    finally:
        signal.signal(signal.SIGINT, before)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert res["interrupted"] and on_disk["interrupted"] and not on_disk["complete"]
    # phases: (a, none) 2 requests, (a, n=2) 2 requests: the 4th request's phase is dropped
    assert [(p["kind"], p["config"]) for p in on_disk["phases"]] == [("a", "none")]
    write_report(tmp_path, on_disk)
    assert "**Interrupted**" in (tmp_path / "report.md").read_text()


# -- the real model, in this process -------------------------------------------------------------------------
def test_in_process_tiny_run_writes_everything(tmp_path, capsys, monkeypatch):
    import matplotlib.image

    from gemmaspec.bench import targets as tg

    kept = []
    monkeypatch.setattr(tg.InProcessTarget, "close", lambda self: kept.append(self))
    suite = _write(tmp_path, [{"kind": "rewrite", "prompt": "Repeat: one two three four. Repeated: one two"},
                              {"kind": "rewrite", "prompt": "List: red, green, blue. Again: red,"}])
    out = tmp_path / "out"
    # draft-mtp without -md: the assistant gemmaspec ships for the default model
    rc = main(["bench", "--suite", str(suite), "--spec-type", "ngram-simple,draft-mtp", "--spec-draft-n-max",
               "2,choose2", "--users", "1,2", "--repeats", "1", "--max-tokens", "8", "--out", str(out), "--no-progress",
               "-t", "1"])
    err = capsys.readouterr().err
    assert rc == 0, err
    # no log line per request (the server's ``bench: slot 0 | prompt ...``): thousands in a default run
    assert not [ln for ln in err.splitlines() if "slot" in ln and "prefill" in ln], err
    target = kept[0]
    try:
        res = json.loads((out / "results.json").read_text())
        assert res["complete"] and res["targets"][0]["model_sha256"] and res["settings"]["configs"] == [
            "none", "ngram-simple n=2", "ngram-simple n=choose2", "draft-mtp n=2", "draft-mtp n=choose2"]
        assert len(res["phases"]) == 10 and all(len(p["requests"]) == 2 for p in res["phases"])
        for ph in res["phases"]:
            assert ph["memory"]["peak_rss_mib"] > 0
            chosen = ph["config"].endswith("choose2")
            # the lengths chosen per round: the cost model's prediction next to what the rounds took
            assert (ph["planner"]["rounds"] > 0) == chosen and ph["planner"]["seconds"] >= 0
            for r in ph["requests"]:
                assert r["completion_tokens"] == len(r["tokens"]) == 8
                assert r["spec"]["source"] == "engine"
                assert bool(r["spec"].get("chosen_n")) == chosen
                if not chosen:
                    assert (r["spec"]["draft_n"] > 0) == (ph["config"] != "none")
        assert "Draft lengths chosen per round" in (out / "report.md").read_text()
        assert res["lossless"] == []  # greedy speculation and batching change no token
        for name in PLOTS + ("report.md",):
            assert (out / name).stat().st_size > 0
        # one panel per drafter (ngram-simple, draft-mtp): 450 pixels for the first, PANEL_HEIGHT more for the second
        assert matplotlib.image.imread(out / "users.png").shape[:2] == (round((PLOT_SIZE[1] + PANEL_HEIGHT) * PLOT_DPI),
                                                                       800)
        # a planted mismatch is caught, with its position and the target's top-2 margin there
        spec_ph = next(p for p in res["phases"] if p["config"] != "none" and p["users"] == 2)
        spec_ph["requests"][1]["tokens"][5] += 1
        by = {(p.kind, p.index): p for p in load_suite(suite)}
        got = analyze.lossless(res, lambda t, k, i, prefix: target.top2_margin(by[(k, i)], prefix))
        assert [(m["config"], m["users"], m["index"], m["position"]) for m in got] == [
            ("ngram-simple n=2", 2, spec_ph["requests"][1]["index"], 5)]
        assert got[0]["top2_margin"] > 0
    finally:
        for s in target.schedulers.values():
            s.close()


def test_url_mode_against_gemmaspec_serve(tmp_path, capsys, server):
    """Our own server: acceptance from each response's ``timings``; ``speculative.n_max: 0`` turns
    drafting off per request; greedy outputs identical with and without."""
    suite = _write(tmp_path, [{"kind": "rewrite", "prompt": "Repeat: one two three four. Repeated: one two"}])
    out = tmp_path / "out"
    rc = main(["bench", "--url", server.url, "--suite", str(suite), "--spec-draft-n-max", "2,choose2", "--users",
               "1,2", "--repeats", "1", "--max-tokens", "6", "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    assert res["targets"][0]["metrics"] is True and res["targets"][0]["props"]["speculative"]["type"] == "ngram-simple,draft-mtp"
    assert len(res["phases"]) == 6
    for ph in res["phases"]:
        chosen = ph["n_max"] == "choose2"  # sent as n_max 2 without speculative.n_fixed; the others fixed
        assert (ph["planner"]["rounds"] > 0) == chosen
        for r in ph["requests"]:
            assert r["completion_tokens"] == 6 and r["spec"]["source"] == "timings"
            if not chosen:
                assert (r["spec"]["draft_n"] > 0) == (ph["n_max"] != 0)
    assert res["lossless"] == []


def test_a_peer_runs_only_the_drafters_it_has():
    """llama.cpp's peer has only prompt lookup: its draft-mtp phases are left out, not run as n-gram."""
    from gemmaspec.bench.run import Config, plan
    from gemmaspec.bench.suite import Prompt
    from gemmaspec.bench.targets import LlamaCppTarget

    class Ours:
        name = "gemmaspec"

    peer = LlamaCppTarget.__new__(LlamaCppTarget)
    prompts = [Prompt(kind="qa", prompt="Q?", messages=None, max_tokens=None, index=0, line=1)]
    cfgs = [Config("ngram-simple", 0), Config("ngram-simple", 3), Config("draft-mtp", 3)]
    got = [(t.name, c.label, u) for _, _, u, c, t in plan(prompts, [1, 2], cfgs, [Ours(), peer], 1)]
    assert ("llama.cpp", "ngram-simple n=3", 1) in got and ("llama.cpp", "none", 1) in got
    assert not any(n == "llama.cpp" and (c.startswith("draft-mtp") or u > 1) for n, c, u in got)
    assert sum(n == "gemmaspec" for n, _, _ in got) == 6


def test_the_report_records_the_assistant_a_list_drafts_with():
    """``--spec-type ngram-simple+draft-mtp`` or ``default`` (which is that list for the default model)
    draft with the shipped assistant: the report's ``drafts`` names it and its sha256, as for
    ``draft-mtp`` alone (it recorded nothing, so a run did not say which assistant it measured)."""
    from gemmaspec.bench.targets import InProcessTarget
    from gemmaspec.manage.default_model import default_model_path
    from gemmaspec.manage.shipped import shipped_assistant

    t = InProcessTarget(None, [], ["default", "ngram-simple,draft-mtp"], 1, 256)
    try:
        d = t.describe()
        assert d["spec_types"] == ["ngram-simple,draft-mtp"]
        assert d["drafts"]["draft-mtp"]["path"] == shipped_assistant(default_model_path())
        assert len(d["drafts"]["draft-mtp"]["sha256"]) == 64
    finally:
        t.close()


def test_the_report_gives_the_p_min_each_model_drafter_ran_with(tmp_path, capsys):
    """The assistant's p-min changes what is measured (acceptance 0.32 at 0, 0.63 at its shipped 0.3 on
    the speculative prompts at n-max 3): the target's description gives it per type, and
    ``--spec-draft-p-min`` sets it (there was no way to say or set it)."""
    from gemmaspec.bench.targets import InProcessTarget

    t = InProcessTarget(None, [], ["ngram-simple", "ngram-simple,draft-mtp"], 1, 256)
    try:
        assert t.describe()["p_min"] == {"ngram-simple,draft-mtp": 0.3}  # the shipped assistant's own
    finally:
        t.close()
    t = InProcessTarget(None, [], ["draft-mtp"], 1, 256, p_min=0.0)
    try:
        assert t.describe()["p_min"] == {"draft-mtp": 0.0}
    finally:
        t.close()
    capsys.readouterr()
    assert "[0, 1]" in _one_line_error(capsys, ["bench", "--spec-draft-p-min", "2", "--out", str(tmp_path / "o")])
