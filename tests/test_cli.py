"""The command line: streaming output, stats on stderr, and one-line errors for bad input."""

import re
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFWriter

from conftest import run_cli


def _assert_one_line_error(res, *needles):
    assert res.returncode == 1, (res.returncode, res.stderr)
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert res.stdout == ""


def _tiny_gguf(path, arch="gemma3", tensor_type=T.F32):
    w = GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.embedding_length", 32)
    w.add_uint32(f"{arch}.block_count", 1)
    w.add_uint32(f"{arch}.feed_forward_length", 64)
    w.add_uint32(f"{arch}.attention.head_count", 2)
    w.add_uint32(f"{arch}.attention.head_count_kv", 1)
    w.add_uint32(f"{arch}.attention.key_length", 16)
    w.add_token_list(["<pad>", "<eos>", "<bos>", "<unk>"] + [f"t{i}" for i in range(252)])
    if tensor_type == T.F32:
        w.add_tensor("token_embd.weight", np.zeros((256, 32), np.float32))
    else:  # IQ4_XS: 136 bytes per 256 values
        w.add_tensor("token_embd.weight", np.zeros((32, 136), np.uint8), raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_generate_streams_text_and_stats(model_path):
    res = run_cli("generate", "-m", str(model_path), "-p", "The capital of France is", "-n", "12", "--temp", "0")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() and "The capital of France is" not in res.stdout
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith("speculation: ngram-simple,draft-mtp, n-max 3")  # on by default, said first
    stats = next(ln for ln in lines if "TTFT" in ln)
    for word in ("prompt", "prefill", "tokens/s", "generated 12 tokens", "decode", "TTFT"):
        assert word in stats, stats
    # no chatter by default: no provenance, no memory estimate, no base-model note (no --chat)
    assert not any(ln.startswith(("memory (", "  why:", "note:")) for ln in lines), res.stderr


def test_verbose_adds_why_and_the_memory_estimate(model_path):
    res = run_cli("generate", "-m", str(model_path), "-p", "Hi", "-n", "2", "--temp", "0", "-v")
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("speculation: "))
    assert lines[i + 1].startswith("  why: measured by"), res.stderr
    assert any(re.match(r"memory \(cpu\): target [\d.]+ MiB", ln) for ln in lines), res.stderr


def test_greedy_output_is_reproducible_and_pipeable(model_path):
    args = ("generate", "-m", str(model_path), "-p", "List three colors:", "-n", "10", "--temp", "0")
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == second.returncode == 0, (first.stderr, second.stderr)
    assert first.stdout.strip() and first.stdout == second.stdout  # two crashes would print the same nothing


def test_default_model_runs_without_m():
    res = run_cli("generate", "-p", "Hello", "-n", "3", "--temp", "0")
    assert res.returncode == 0, res.stderr


def test_missing_file(tmp_path):
    _assert_one_line_error(run_cli("generate", "-m", str(tmp_path / "nope.gguf"), "-p", "x"), "not found")


def test_not_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("this is not a model")
    _assert_one_line_error(run_cli("generate", "-m", str(p), "-p", "x"), "not a GGUF file")


def test_truncated_gguf(tmp_path, model_path):
    p = tmp_path / "cut.gguf"
    with open(model_path, "rb") as f:
        p.write_bytes(f.read(50_000_000))
    _assert_one_line_error(run_cli("generate", "-m", str(p), "-p", "x"), "truncated")
    p.write_bytes(p.read_bytes()[:2000])  # cut inside the metadata
    _assert_one_line_error(run_cli("generate", "-m", str(p), "-p", "x"), "truncated or corrupt")


def test_unsupported_architecture(tmp_path):
    p = _tiny_gguf(tmp_path / "llama.gguf", arch="llama")
    _assert_one_line_error(run_cli("generate", "-m", str(p), "-p", "x"), "'llama' is not supported", "gemma3")


def test_unsupported_tensor_type(tmp_path):
    p = _tiny_gguf(tmp_path / "iq.gguf", tensor_type=T.IQ4_XS)
    _assert_one_line_error(run_cli("generate", "-m", str(p), "-p", "x"), "IQ4_XS", "supported")


def test_unknown_tensor_type_id(tmp_path):
    p = _tiny_gguf(tmp_path / "odd.gguf")
    data = bytearray(p.read_bytes())
    name = b"token_embd.weight"
    i = data.index(name) + len(name)  # then: n_dims u32, dims u64 x n, type u32
    n_dims = int.from_bytes(data[i:i + 4], "little")
    t = i + 4 + 8 * n_dims
    data[t:t + 4] = (250).to_bytes(4, "little")
    p.write_bytes(bytes(data))
    _assert_one_line_error(run_cli("generate", "-m", str(p), "-p", "x"), "unknown type")


def test_prompt_longer_than_context(model_path):
    res = run_cli("generate", "-m", str(model_path), "-c", "16", "-p", "word " * 40)
    _assert_one_line_error(res, "the prompt is", "the context is 16")


@pytest.mark.parametrize("flags,needle", [
    (["--temp", "-1"], "temperature"), (["--top-p", "2"], "top-p"), (["-n", "0"], "tokens"),
    (["--min-p", "-0.5"], "min-p"), (["-c", "999999"], "exceeds the model's context"),
])
def test_out_of_range_flags(model_path, flags, needle):
    _assert_one_line_error(run_cli("generate", "-m", str(model_path), "-p", "x", *flags), needle)


def test_inspect(model_path):
    res = run_cli("inspect", str(model_path))
    assert res.returncode == 0, res.stderr
    for word in ("architecture: gemma3", "num_layers: 18", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "sssssF"):
        assert word in res.stdout, word


def test_speculative_flags_and_acceptance_line(model_path):
    base = ("generate", "-m", str(model_path), "-p", "List: apple, pear, plum, apple, pear, plum, apple,", "-n", "24",
            "--temp", "0")
    plain = run_cli(*base)
    spec = run_cli(*base, "--spec-type", "ngram-simple", "--spec-draft-n-max", "4")
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    last = spec.stderr.strip().splitlines()[-1]
    assert last.startswith("draft acceptance = ") and "accepted /" in last and "mean len =" in last
    auto = run_cli(*base, "--spec-type", "ngram-simple", "--spec-draft-n-max", "auto")
    assert auto.returncode == 0 and auto.stdout == plain.stdout


def test_a_spec_type_list_drafts_with_ngram_then_the_draft_model(model_path, tmp_path):
    """``--spec-type draft-simple,ngram-simple`` (llama.cpp's comma-separated list, either order): n-gram
    lookup drafts where it matches, the draft model elsewhere; the output is plain greedy's; stderr has
    llama.cpp's per-drafter statistics lines, ``--json`` their counts; the server takes the same list."""
    import json

    import httpx

    from conftest import ServerProcess

    base = ("generate", "-m", str(model_path), "-p", "The capital of France is Paris. The capital of Italy is", "-n", "24",
            "--temp", "0")
    plain = run_cli(*base)
    res = run_cli(*base, "-md", str(model_path), "--spec-type", "draft-simple,ngram-simple", "--spec-draft-n-max", "3",
                  "--json")
    assert res.returncode == 0, res.stderr
    text, record = res.stdout.rsplit("\n", 2)[0], json.loads(res.stdout.strip().splitlines()[-1])
    assert plain.stdout.startswith(text) and record["spec_type"] == "ngram-simple,draft-simple"
    by = record["by_drafter"]
    assert set(by) == {"ngram-simple", "draft-simple"} and by["draft-simple"]["acceptance_rate"] == 1.0
    assert sum(v["drafted"] for v in by.values()) == record["drafted"]  # the record's own key names and rounding
    assert all(set(v) == {"drafted", "accepted", "verify_steps", "acceptance_rate", "mean_accepted_length"}
               and v["acceptance_rate"] == round(v["accepted"] / v["drafted"], 5) for v in by.values())
    assert "statistics ngram-simple: #gen drafts = " in res.stderr and "statistics draft-simple: " in res.stderr
    bad = run_cli(*base, "--spec-type", "draft-simple,draft-mtp")
    assert bad.returncode != 0 and "one model type" in bad.stderr
    s = ServerProcess(tmp_path, "-np", "1", "-c", "512", "-md", str(model_path), "--spec-type", "ngram-simple,draft-simple")
    try:
        props = httpx.get(s.url + "/props", timeout=30).json()
        assert props["speculative"]["type"] == "ngram-simple,draft-simple"
        r = httpx.post(s.url + "/completion", json={"prompt": "The capital of France is Paris. The capital of Italy is",
                                                      "n_predict": 24, "temperature": 0}, timeout=120).json()
        assert plain.stdout.startswith(r["content"]) and r["timings"]["draft_n"] > 0
    finally:
        s.close()


def test_draft_model_with_itself_accepts_everything(model_path):
    res = run_cli("generate", "-m", str(model_path), "-md", str(model_path), "--spec-type", "draft-simple",
                  "-p", "The capital of France is", "-n", "13", "--temp", "0", "--spec-draft-n-max", "3")
    assert res.returncode == 0, res.stderr
    assert "draft acceptance = 1.00000" in res.stderr



def test_md_without_spec_type_drafts_with_that_model(model_path):
    """``-md`` alone turns drafting on with that model, as llama.cpp does (it was an error: "-md is used
    by --spec-type draft-simple or draft-mtp, not none"); ``--spec-type none`` does not draft."""
    res = run_cli("generate", "-m", str(model_path), "-md", str(model_path), "-p", "The capital of France is",
                  "-n", "9", "--temp", "0", "--spec-draft-n-max", "3")
    assert res.returncode == 0, res.stderr
    assert "draft acceptance = 1.00000" in res.stderr
    plain = run_cli("generate", "-m", str(model_path), "-p", "The capital of France is", "-n", "9", "--temp", "0",
                    "--spec-type", "none")
    assert plain.returncode == 0 and "draft acceptance" not in plain.stderr and plain.stdout == res.stdout
    assert "speculation: off" in plain.stderr


def test_json_and_memory_line_name_the_drafter_that_runs(model_path):
    """``--json``'s ``spec_type`` is the drafter that ran, not the flag as typed (it said ``default``, or
    null for ``-md`` alone); the memory estimate counts a list's draft model (it said ``drafter 0.0 MiB``
    for ``ngram-simple,draft-simple``, whose draft model is as large as the target here)."""
    import json

    base = ("generate", "-m", str(model_path), "-p", "The capital of France is", "-n", "4", "--temp", "0", "--json",
            "--verbose")  # the memory line is said with --verbose
    runs = {"default": run_cli(*base, "--spec-type", "default"), "md": run_cli(*base, "-md", str(model_path)),
            "list": run_cli(*base, "-md", str(model_path), "--spec-type", "ngram-simple,draft-simple")}
    rec = {k: json.loads(r.stdout.strip().splitlines()[-1]) for k, r in runs.items()}
    assert rec["default"]["spec_type"] == "ngram-simple,draft-mtp"  # the default model's shipped default
    assert "with the assistant shipped for this model (gemma-3-270m-assistant-q4_0.gguf, p-min 0.3)" \
        in runs["default"].stderr
    assert rec["md"]["spec_type"] == "draft-simple" and rec["list"]["spec_type"] == "ngram-simple,draft-simple"
    mem = {k: re.search(r"target ([\d.]+) MiB \+ drafter ([\d.]+) MiB", r.stderr).groups() for k, r in runs.items()}
    assert mem["list"][1] == mem["md"][1] == mem["list"][0]  # the draft model is the target's file
    assert 0 < float(mem["default"][1]) < 10  # the shipped assistant, 4.3 MiB


def test_serve_refuses_bad_speculative_flags_before_listening(model_path):
    """A p-min out of range, or ``-md`` with a type that drafts without a model, is refused before the
    server binds its port (it listened, answered 503, then exited)."""
    for flags, needle in ((["--spec-draft-p-min", "1.5"], "[0, 1]"), (["--spec-draft-p-min", "nan"], "[0, 1]"),
                          (["--spec-type", "default", "-md", str(model_path)], "-md is used by")):
        res = run_cli("serve", "-m", str(model_path), "--port", "0", *flags, timeout=60)
        _assert_one_line_error(res, needle)


@pytest.mark.parametrize("flags,needle", [
    (["--spec-type", "ngram-simple", "--spec-draft-n-max", "x"], "--spec-draft-n-max"),
    (["--spec-type", "ngram-simple", "--spec-draft-n-max", "300"], "0..256"),
    (["--spec-type", "draft-simple"], "needs a draft model"),
    (["--spec-type", "draft-simple", "-md", "/nonexistent.gguf"], "not found"),
    (["--spec-type", "ngram-simple", "--spec-ngram-size", "2", "--spec-ngram-min", "3"], "n-gram sizes"),
])
def test_speculative_bad_flags(model_path, flags, needle):
    _assert_one_line_error(run_cli("generate", "-m", str(model_path), "-p", "x", *flags), needle)


def test_generate_json_is_the_last_stdout_line(model_path):
    import json

    base = ("generate", "-m", str(model_path), "-p", "List: apple, pear, plum, apple, pear, plum, apple,", "-n", "16",
            "--temp", "0", "--seed", "7", "--spec-type", "ngram-simple")
    res = run_cli(*base, "--json")
    plain = run_cli(*base)
    assert res.returncode == 0, res.stderr
    text, last = res.stdout.rstrip("\n").rsplit("\n", 1)
    assert text + "\n" == plain.stdout  # the text itself is unchanged
    rec = json.loads(last)
    assert rec["generated_tokens"] == 16 and rec["stop_reason"] == "length" and rec["seed"] == 7
    assert rec["prompt_tokens"] > 5 and rec["prefill_tps"] > 0 and rec["decode_tps"] > 0 and rec["load_s"] > 0
    assert rec["ttft_ms"] > 0 and rec["spec_type"] == "ngram-simple" and rec["n_max"] == 3
    assert 0 < rec["accepted"] <= rec["drafted"] and rec["acceptance_rate"] == round(rec["accepted"] / rec["drafted"], 5)
    assert rec["mean_accepted_length"] == round(1 + rec["accepted"] / rec["verify_steps"], 4)
    assert f"draft acceptance = {rec['acceptance_rate']:.5f}" in res.stderr


def test_one_token_has_no_decode_speed(model_path):
    import json

    res = run_cli("generate", "-m", str(model_path), "-p", "Hello", "-n", "1", "--temp", "0", "--json")
    assert res.returncode == 0, res.stderr
    assert "decode n/a (1 token)" in res.stderr
    assert not re.search(r"(?<![\d.])0\.0 tokens/s", res.stderr)  # no "decode 0.0"; "prefill 30.0" is fine
    assert json.loads(res.stdout.splitlines()[-1])["decode_tps"] is None


def test_prompt_from_file_equals_prompt_flag(model_path, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("The capital of France is")
    args = ("generate", "-m", str(model_path), "-n", "6", "--temp", "0")
    from_file = run_cli(*args, "-f", str(f))
    assert from_file.returncode == 0, from_file.stderr
    assert from_file.stdout == run_cli(*args, "-p", "The capital of France is").stdout
    _assert_one_line_error(run_cli(*args, "-f", str(tmp_path / "none.txt")), "cannot read the prompt file")


@pytest.mark.parametrize("cmd,flags,needle", [
    ("generate", ["-fa", "on"], "-fa"), ("generate", ["--mlock"], "--mlock"), ("generate", ["--no-mmap"], "--no-mmap"),
    ("generate", ["-cnv"], "gemmaspec chat"), ("generate", ["-hf", "org/repo"], "-m FILE"),
    ("generate", ["-ctk", "q8_0"], "-ctk"), ("serve", ["-cb"], "-cb"),
    ("generate", ["--n-pred", "4"], "unrecognized arguments: --n-pred"),  # no abbreviations
])
def test_llama_cpp_flags_refused_by_name(cmd, flags, needle):
    res = run_cli(cmd, *(["-p", "x"] if cmd == "generate" else []), *flags)
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert needle in last and "Traceback" not in res.stderr, last


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_unknown_flag_names_the_subcommand(cmd):
    """As argparse does for every other bad flag of a subcommand: its own usage and prog name."""
    res = run_cli(cmd, *(["-p", "x"] if cmd == "generate" else []), "--bogus")
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert last == f"gemmaspec {cmd}: error: unrecognized arguments: --bogus", res.stderr
    assert res.stderr.startswith(f"usage: gemmaspec {cmd} ")


def test_ngl_is_accepted_and_explained(model_path):
    res = run_cli("generate", "-m", str(model_path), "-p", "Hi", "-n", "2", "--temp", "0", "-ngl", "99")
    assert res.returncode == 0, res.stderr
    assert "-ngl 99 ignored" in res.stderr and "--device" in res.stderr


def test_version():
    from gemmaspec import __version__

    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"gemmaspec {__version__}"


@pytest.mark.parametrize("ctx", ["-1", "1"])
def test_bad_context_size(model_path, ctx):
    _assert_one_line_error(run_cli("generate", "-m", str(model_path), "-p", "x", "-c", ctx), "-c must be 0", ctx)


def test_serve_says_listening_once_it_answers(model_path, tmp_path):
    """The ``listening on`` line comes once the port answers HTTP (it came ~2 s before uvicorn served the
    port): a request sent as the line appears is answered at once (503 while the model loads, or 200)."""
    import subprocess
    import sys
    import time

    import httpx

    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "gemmaspec", "serve", "--port", "0", "-m", str(model_path),
                                 "-np", "1", "-c", "256"], stdout=subprocess.DEVNULL, stderr=f,
                                stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.005)
        t0 = time.monotonic()
        r = httpx.get(m.group(1) + "/health", timeout=5)
        took = time.monotonic() - t0
        assert r.status_code in (200, 503) and took < 1.0, (r.status_code, took)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_the_listening_line_waits_until_the_port_is_served(monkeypatch):
    """serve's uvicorn server says its line after its startup (the app's lifespan begun, every socket
    served), however long that takes (here a lifespan start of 0.6 s); a request sent on the line is
    answered at once. (The line was printed before uvicorn started, with the socket listening unserved.)"""
    import asyncio
    import socket
    import sys
    import threading
    import time

    import httpx
    import uvicorn

    from gemmaspec.cli.serve import _announcing_server

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await asyncio.sleep(0.6)
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        else:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    seen = {}

    class Stderr:  # notes when the line comes
        def write(self, text):
            if "listening" in text:
                seen.setdefault("line", time.monotonic())

        def flush(self):
            pass

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    server = _announcing_server(uvicorn)(uvicorn.Config(app, log_level="warning", lifespan="on"), "listening")
    monkeypatch.setattr(sys, "stderr", Stderr())
    t0 = time.monotonic()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while "line" not in seen:
            assert thread.is_alive() and time.monotonic() - t0 < 30
            time.sleep(0.002)
        r = httpx.get(f"http://127.0.0.1:{sock.getsockname()[1]}/", timeout=5)
        answered = time.monotonic()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
    assert seen["line"] - t0 >= 0.6 and r.text == "ok" and answered - seen["line"] < 0.5, (seen["line"] - t0,
                                                                                          answered - seen["line"])


def test_serve_missing_model_fails_before_listening(tmp_path):
    res = run_cli("serve", "--port", "0", "-m", str(tmp_path / "missing.gguf"), timeout=60)
    _assert_one_line_error(res, "not found", "missing.gguf")
    assert "listening" not in res.stderr


def test_draft_mtp_without_md_uses_the_shipped_assistant(model_path):
    """The default model has an assistant shipped with gemmaspec: ``--spec-type draft-mtp`` finds it
    (and says so); output equals plain greedy output."""
    common = ("generate", "-m", str(model_path), "-p", "def add(a, b):", "-n", "12", "--temp", "0")
    res = run_cli(*common, "--spec-type", "draft-mtp")
    assert res.returncode == 0, res.stderr
    assert "the assistant shipped for this model" in res.stderr
    assert res.stdout == run_cli(*common, "--spec-type", "none").stdout



def test_the_memory_line_counts_the_shipped_assistant_without_m():
    """``make run`` gives no ``-m`` (the default model) and ``--spec-type default``: the estimate counts
    the assistant that then drafts (it said ``drafter 0.0 MiB``: the shipped-assistant lookup got no path)."""
    import re

    r = run_cli("generate", "-p", "Hello", "-n", "2", "--temp", "0", "--spec-type", "default", "-v")
    assert r.returncode == 0, r.stderr
    drafter = float(re.search(r"\+ drafter ([\d.]+) MiB", r.stderr).group(1))
    assert 0 < drafter < 10, r.stderr
