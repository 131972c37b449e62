"""`gemmaspec export`: the printed commands, parsed back, carry the same model, drafter and settings."""

import argparse
import json
import shlex

import pytest
import torch
from tiny_gemma4 import TARGET, randomize, tiny_assistant

from gemmaspec import cli
from gemmaspec.cli.export import _gpu_estimate, tensor_parallel


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    root = tmp_path_factory.mktemp("export")
    randomize(Gemma4ForCausalLM(Gemma4TextConfig(**TARGET)).eval(), 1).to(torch.bfloat16).save_pretrained(root / "t")
    tiny_assistant().to(torch.bfloat16).save_pretrained(root / "a")
    return root / "t", root / "a"


def _run(capsys, *args):
    assert cli.main(["export", *args]) == 0
    return shlex.split(capsys.readouterr().out.strip())


def _flags(argv, spec):
    p = argparse.ArgumentParser(add_help=False)
    for names, kw in spec:
        p.add_argument(*names, **kw)
    ns, rest = p.parse_known_args(argv)
    return ns, rest


def test_llama_server_command(capsys, model_path):
    argv = _run(capsys, "llama-server", "-m", str(model_path), "-md", str(model_path), "--spec-type", "draft-simple",
                "--spec-draft-n-max", "5", "-c", "1024", "-np", "2")
    assert argv[0] == "llama-server"
    ns, rest = _flags(argv[1:], [(("-m",), {}), (("-md",), {}), (("--spec-type",), {}),
                                 (("--spec-draft-n-max",), {"type": int}), (("-c",), {"type": int}),
                                 (("-np",), {"type": int}), (("--port",), {"type": int})])
    assert not rest
    assert (ns.m, ns.md, ns.spec_type, ns.spec_draft_n_max, ns.np) == (str(model_path), str(model_path),
                                                                       "draft-simple", 5, 2)
    assert ns.c == 1024 * 2  # llama-server's -c is shared by its slots


def test_vllm_command_carries_the_assistant_and_draft_length(capsys, dirs):
    t, a = dirs
    argv = _run(capsys, "vllm", "-m", str(t), "-md", str(a), "--spec-draft-n-max", "4", "-c", "256", "-np", "3")
    assert argv[:3] == ["vllm", "serve", str(t)]
    ns, rest = _flags(argv[3:], [(("--speculative-config",), {"type": json.loads}),
                                 (("--max-model-len",), {"type": int}), (("--max-num-seqs",), {"type": int}),
                                 (("--tensor-parallel-size",), {"type": int}), (("--port",), {"type": int})])
    assert not rest
    assert ns.speculative_config == {"method": "mtp", "model": str(a), "num_speculative_tokens": 4}
    assert (ns.max_model_len, ns.max_num_seqs, ns.tensor_parallel_size) == (256, 3, 1)


def test_tensor_parallel_grows_with_the_model(capsys, dirs):
    t, a = dirs
    small = _run(capsys, "vllm", "-m", str(t), "-md", str(a), "--gpu-mem", "80GiB")
    need = _gpu_estimate(str(t), str(a), 512, 4)[0]
    gpu = int(need / 0.9 / 3)  # a third of the need per GPU: 4 GPUs (a power of two dividing the heads)
    tiny_gpu = _run(capsys, "sglang", "-m", str(t), "-md", str(a), "--gpu-mem", str(gpu), "-c", "512", "-np", "4")
    assert small[small.index("--tensor-parallel-size") + 1] == "1"
    tp = int(tiny_gpu[tiny_gpu.index("--tp-size") + 1])
    assert tp == 4 and TARGET["num_attention_heads"] % tp == 0
    assert tiny_gpu[tiny_gpu.index("--speculative-draft-model-path") + 1] == str(a)
    assert tensor_parallel(100, 100, 8) == 2 and tensor_parallel(10, 100, 8) == 1


def test_ngram_and_errors(capsys, dirs, model_path):
    t, _ = dirs
    argv = _run(capsys, "vllm", "-m", str(t), "--spec-type", "ngram-simple", "--spec-draft-n-max", "3")
    cfg = json.loads(argv[argv.index("--speculative-config") + 1])
    assert cfg["method"] == "ngram" and cfg["num_speculative_tokens"] == 3
    assert cli.main(["export", "llama-server", "-m", str(t)]) == 1  # a directory: llama-server needs GGUF
    assert "convert" in capsys.readouterr().err


def test_a_spec_type_list_goes_to_llama_server_only(capsys, dirs, model_path):
    """``--spec-type draft-simple,ngram-simple``: llama-server takes the comma-separated list (in its
    order, draftless first); vLLM and SGLang take one method, so the list is refused by name."""
    argv = _run(capsys, "llama-server", "-m", str(model_path), "-md", str(model_path), "--spec-type",
                "draft-simple,ngram-simple", "--spec-draft-n-max", "2")
    assert argv[argv.index("--spec-type") + 1] == "ngram-simple,draft-simple"
    t, a = dirs
    assert cli.main(["export", "vllm", "-m", str(t), "-md", str(a), "--spec-type", "ngram-simple,draft-mtp"]) == 1
    assert "vllm takes one speculative method" in capsys.readouterr().err
    # without -md the list drafts with the assistant shipped for the default model, as generate does
    argv = _run(capsys, "llama-server", "-m", str(model_path), "--spec-type", "ngram-simple,draft-mtp")
    assert argv[argv.index("-md") + 1].endswith("gemma-3-270m-assistant-q4_0.gguf")
    assert cli.main(["export", "llama-server", "-m", str(t), "--spec-type", "ngram-simple,draft-mtp"]) == 1
    assert "needs the target's assistant: -md" in capsys.readouterr().err  # none ships for this target


def test_no_flags_export_gemmaspecs_default_speculation(capsys, model_path):
    """``export llama-server`` with no speculative flags carries what ``generate`` and ``serve`` run for
    the model: for the default model the list with the shipped assistant at its p-min (it dropped
    speculation); vLLM takes one method and cannot load that assistant, so it gets n-gram lookup, said."""
    from gemmaspec.speculative.config import SpecConfig
    from gemmaspec.speculative.plan import plan

    pl = plan(SpecConfig(), model_path)
    argv = _run(capsys, "llama-server", "-m", str(model_path))
    ns, rest = _flags(argv[1:], [(("-m",), {}), (("-md",), {}), (("--spec-type",), {}),
                                 (("--spec-draft-n-max",), {"type": int}), (("--spec-draft-p-min",), {"type": float}),
                                 (("--port",), {"type": int}), (("-np",), {"type": int}), (("-c",), {"type": int})])
    assert not rest
    assert (ns.spec_type, ns.md, ns.spec_draft_p_min) == (pl.spec_type, pl.draft_file, pl.p_min)
    assert pl.spec_type == "ngram-simple,draft-mtp" and pl.p_min > 0
    assert _run(capsys, "llama-server", "-m", str(model_path), "--spec-type", "none", "-np", "3") == \
        ["llama-server", "-m", str(model_path), "--port", "8080", "-np", "3", "-c", str(3 * 4096)]  # 4096 per slot


def test_export_refuses_what_generate_refuses_and_says_what_it_drops(capsys, tmp_path, model_path):
    """A missing file or an assistant as -m: one error line and no command (it printed one); settings the
    other server cannot take are named on stderr; a refused export prints no note before its error."""
    from gemmaspec.manage.shipped import shipped_assistant

    for m in (str(tmp_path / "missing.gguf"), shipped_assistant(model_path)):
        assert cli.main(["export", "llama-server", "-m", m]) == 1
        out = capsys.readouterr()
        assert out.out == "" and out.err.startswith("error: ") and len(out.err.strip().splitlines()) == 1, out.err
    assert cli.main(["export", "vllm"]) == 1  # the default model is a GGUF: vLLM needs a checkpoint
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "need a Hugging Face checkpoint" in err[0], err
    assert cli.main(["export", "llama-server", "--spec-type", "ngram-simple", "--spec-ngram-size", "3",
                     "--spec-draft-n-min", "2"]) == 0
    out = capsys.readouterr()
    argv = shlex.split(out.out.strip())
    assert argv[argv.index("--spec-draft-n-min") + 1] == "2"
    assert "note: llama-server gets no --spec-ngram-size 3 / --spec-ngram-min 1" in out.err


def test_md_of_the_wrong_role_is_refused(capsys, dirs, model_path):
    """``-md`` a model with draft-mtp (alone or in a list), or an assistant with draft-simple: refused
    naming the type that file takes, as generate and serve refuse it (export printed the command)."""
    t, a = dirs
    for argv, says in ((["llama-server", "-m", str(model_path), "-md", str(model_path), "--spec-type",
                         "ngram-simple,draft-mtp"], "use --spec-type ngram-simple,draft-simple"),
                       (["vllm", "-m", str(t), "-md", str(t), "--spec-type", "draft-mtp"], "use --spec-type draft-simple"),
                       (["vllm", "-m", str(t), "-md", str(a), "--spec-type", "draft-simple"], "use --spec-type draft-mtp")):
        assert cli.main(["export", *argv]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: -md ") and says in err, err
