"""End to end on tiny Gemma 4 checkpoints that carry the real Gemma tokenizer: the CLI runs a
Gemma 4 target from a Hugging Face directory, with and without the MTP assistant."""

import json
import re

import pytest

from conftest import run_cli
from tiny_gemma4 import randomize as _randomize

pytestmark = pytest.mark.reference

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tokenizer):
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig

    root = tmp_path_factory.mktemp("g4cli")
    v = tokenizer.vocab_size
    common = dict(vocab_size=v, num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
                  sliding_window=16, max_position_embeddings=1024, hidden_size_per_layer_input=0,
                  vocab_size_per_layer_input=0)
    target = Gemma4ForCausalLM(Gemma4TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                                                layer_types=LAYER_TYPES, final_logit_softcapping=30.0, **common))
    _randomize(target, 5)
    asst = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(
        text_config=Gemma4TextConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     layer_types=["sliding_attention", "full_attention"], **common),
        backbone_hidden_size=32))
    _randomize(asst, 6)
    dirs = {}
    for name, model in (("target", target), ("assistant", asst)):
        d = root / name
        model.save_pretrained(d)
        tokenizer.backend.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
        dirs[name] = d
    return dirs


def test_gemma4_target_generates(tiny_dirs):
    res = run_cli("generate", "-m", str(tiny_dirs["target"]), "-p", "Hello there", "-n", "8", "--temp", "0",
                  "--ignore-eos")
    assert res.returncode == 0, res.stderr
    assert "generated 8 tokens" in res.stderr


def test_draft_mtp_output_equals_plain(tiny_dirs):
    base = ("generate", "-m", str(tiny_dirs["target"]), "-p", "one two three four", "-n", "16", "--temp", "0",
            "--ignore-eos")
    plain = run_cli(*base)
    spec = run_cli(*base, "-md", str(tiny_dirs["assistant"]), "--spec-type", "draft-mtp", "--spec-draft-n-max", "2")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    assert spec.stdout == plain.stdout and "generated 16 tokens" in plain.stderr
    last = spec.stderr.strip().splitlines()[-1]
    m = re.match(r"draft acceptance = [\d.]+ \( *\d+ accepted / +(\d+) generated\)", last)
    assert m and int(m.group(1)) > 0, last  # the assistant really drafted


def test_draft_mtp_refuses_an_assistant_of_another_target(tiny_dirs, model_path):
    """The default Gemma 3 model can feed an MTP assistant (it has the KV layout an assistant reads),
    but not one trained for another target: the pairing check names each mismatch."""
    res = run_cli("generate", "-m", str(model_path), "-md", str(tiny_dirs["assistant"]), "--spec-type", "draft-mtp",
                  "-p", "x")
    assert res.returncode == 1 and "does not belong to this target" in res.stderr
    assert "target of width 32, this target's width is 640" in res.stderr and "head dims differ" in res.stderr


def test_server_serves_gemma4_with_draft_mtp(tiny_dirs, tmp_path):
    """`gemmaspec serve` takes the same draft-mtp flags: two concurrent requests (Gemma 4 slots take
    turns, one forward each) each get exactly the CLI's greedy text, and the metrics count the drafts."""
    import concurrent.futures

    import httpx

    from conftest import ServerProcess

    prompts = ["one two three four", "Hello there"]
    want = [run_cli("generate", "-m", str(tiny_dirs["target"]), "-p", p, "-n", "12", "--temp", "0",
                    "--ignore-eos").stdout[:-1] for p in prompts]  # the CLI ends its output with a newline
    srv = ServerProcess(tmp_path, "-m", str(tiny_dirs["target"]), "-md", str(tiny_dirs["assistant"]),
                        "--spec-type", "draft-mtp", "--spec-draft-n-max", "2", "-np", "2", "-c", "256",
                            "--spec-draft-n-fixed")  # drafts every round: the metrics must count some
    try:
        def ask(p):
            r = httpx.post(srv.url + "/v1/completions", timeout=120,
                           json={"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(ask, prompts))
        assert [g["choices"][0]["text"] for g in got] == want
        assert all(g["timings"]["draft_n"] > 0 for g in got)
        metrics = httpx.get(srv.url + "/metrics").text
        drafted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("spec_decode_num_draft_tokens_total"))
        assert drafted == sum(g["timings"]["draft_n"] for g in got)
    finally:
        srv.close()
