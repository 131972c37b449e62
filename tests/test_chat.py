"""``gemmaspec chat``: a conversation over stdin, one streamed reply per turn, stats per reply."""

from conftest import run_cli


def test_two_turns_then_eof(model_path):
    res = run_cli("chat", "-m", str(model_path), "--temp", "0", "-n", "12", "--ignore-eos",
                  "--spec-type", "ngram-simple", stdin="Hello, who are you?\nAnd what do you like?\n")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    err = res.stderr.strip().splitlines()
    stats = [ln for ln in err if ln.startswith("prompt ") and "generated 12 tokens" in ln]
    accept = [ln for ln in err if ln.startswith("draft acceptance = ")]
    assert len(stats) == 2 and len(accept) == 2, res.stderr
    # the second turn is rendered with the first exchange before it: a longer prompt
    n_prompt = [int(ln.split()[1]) for ln in stats]
    assert n_prompt[1] > n_prompt[0] + 12, n_prompt
    assert len(res.stdout.strip().splitlines()) >= 2 and res.stdout.endswith("\n")


def test_exit_command_leaves_before_later_lines(model_path):
    res = run_cli("chat", "-m", str(model_path), "--temp", "0", "-n", "4", "--ignore-eos",
                  stdin="Hi\n/exit\nThis line is never answered\n")
    assert res.returncode == 0, res.stderr
    assert sum(ln.startswith("prompt ") for ln in res.stderr.splitlines()) == 1, res.stderr
    # no --spec-type: the default speculation, said once at the start and measured per reply
    assert res.stderr.startswith("speculation: ngram-simple,draft-mtp") and "draft acceptance" in res.stderr
    # the default model's file has no chat template: the start says it is a base model, and what to use
    notes = [ln for ln in res.stderr.splitlines() if ln.startswith("note: ")]
    assert len(notes) == 1 and "base (pretrained) model" in notes[0], res.stderr
    assert "`gemmaspec pull gemma-3-1b-it`, then `-m gemma-3-1b-it`" in notes[0]


def test_spec_type_none_turns_speculation_off(model_path):
    res = run_cli("chat", "-m", str(model_path), "--temp", "0", "-n", "4", "--ignore-eos", "--spec-type", "none",
                  stdin="Hi\n")
    assert res.returncode == 0, res.stderr
    assert "speculation: off" in res.stderr and "draft acceptance" not in res.stderr


def test_generate_cnv_points_to_chat_in_one_line(model_path):
    """llama-cli's ``-cnv`` on ``generate``: the hint alone (the whole usage text came first)."""
    res = run_cli("generate", "-m", str(model_path), "-p", "x", "-cnv")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "usage:" not in res.stderr, res.stderr
    assert lines[0].startswith("gemmaspec generate: error: -cnv") and "gemmaspec chat" in lines[0], lines[0]


def test_generate_chat_says_when_the_model_is_a_base_model(model_path):
    args = ("generate", "-m", str(model_path), "-p", "Hi", "-n", "2", "--temp", "0")
    chat, plain = run_cli(*args, "--chat"), run_cli(*args)
    assert chat.returncode == plain.returncode == 0, (chat.stderr, plain.stderr)
    assert "note: this is a base (pretrained) model" in chat.stderr and "gemma-3-1b-it" in chat.stderr
    assert "note:" not in plain.stderr  # continuing text is what a base model is for
