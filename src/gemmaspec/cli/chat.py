"""``gemmaspec chat``: a conversation in the terminal, llama-cli's ``-cnv`` mode.

Each user line becomes a user turn; the whole conversation (system message, earlier turns) is
rendered through the model's chat template and generated from, the reply streamed to stdout. After
each reply stderr gets the stats line and, with speculation, llama-server's acceptance line. The KV
cache is not reused across turns: every turn prefills the conversation again. When the conversation
no longer fits the context, the oldest turns are dropped (said on stderr).

Input: one line per turn; a line ending in ``\\`` continues on the next. ``/exit`` or end of input
(Ctrl-D) leaves; Ctrl-C stops the reply being written (what was written stays in the conversation),
and at the prompt leaves. With ``--mmproj``, ``/image FILE`` (llama-mtmd-cli's) attaches an image to
the next message (:mod:`.images`).
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from ..report import stats_line
from .args import add_common, add_sampling, add_spec, sampling_params
from .images import ChatImages

EXIT_WORDS = ("/exit", "/quit")


def _read_turn(inp: TextIO, interactive: bool) -> str | None:
    """The next user message (continuation lines joined), or None at end of input."""
    lines = []
    while True:
        prompt = ("> " if not lines else ". ") if interactive else ""
        if interactive:
            try:
                line = input(prompt)
            except EOFError:
                return None
        else:
            line = inp.readline()
            if not line:
                return "\n".join(lines) if lines else None
            line = line.rstrip("\n")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def run_chat(engine, drafter, params, n_max=0, n_min: int = 0, system: str | None = None, spec: bool = False,
             inp: TextIO | None = None, out: TextIO | None = None, err: TextIO | None = None, vision=None) -> int:
    """Hold a conversation until ``/exit`` or end of input. Returns the exit status (0).

    Args:
        engine: a loaded :class:`~gemmaspec.engine.Engine`.
        drafter: the drafter (None: plain decoding), reused for every turn.
        params: sampling parameters (``max_tokens`` bounds each reply).
        n_max, n_min: draft length bounds, as for :meth:`Engine.generate`.
        system: system message, kept at the head of the conversation.
        spec: print the acceptance line after each reply.
        inp, out, err: streams (default stdin, stdout, stderr); a terminal on ``inp`` gets a ``> ``
            prompt and line editing.
        vision: the loaded vision tower (``--mmproj``), or None: ``/image FILE`` is then refused.

    Raises:
        GemmaspecError: a turn that fails in a way that is not about its own length (bad template).
    """
    from ..engine import RequestStats

    inp, out, err = inp or sys.stdin, out or sys.stdout, err or sys.stderr
    interactive = inp is sys.stdin and inp.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print("gemmaspec chat: type a message and press Enter; /exit or Ctrl-D leaves, Ctrl-C stops a reply",
              file=err)
    head = [{"role": "system", "content": system}] if system else []
    turns: list[dict] = []  # user/assistant messages, oldest first
    chat_images = ChatImages(engine, vision, err)
    while True:
        try:
            text = _read_turn(inp, interactive)
        except KeyboardInterrupt:
            print(file=err)
            return 0
        if text is None or text.strip() in EXIT_WORDS:
            return 0
        if not text.strip() or chat_images.command(text):
            continue
        turns.append(chat_images.message(text))
        ids, spans = chat_images.encode(head, turns)
        dropped = 0
        while ids is not None and len(ids) >= engine.ctx_size and len(turns) > 1:
            del turns[:2]  # the oldest user turn and its reply
            dropped += 1
            ids, spans = chat_images.encode(head, turns)
        if ids is None:  # an image or a template that cannot take it: said on stderr
            turns.pop()
            continue
        if dropped:
            print(f"(context of {engine.ctx_size} tokens full: dropped the {dropped} oldest exchange"
                  f"{'s' if dropped > 1 else ''})", file=err)
        if len(ids) >= engine.ctx_size:
            print(f"error: this message is {len(ids)} tokens with the chat template, the context is "
                  f"{engine.ctx_size} (-c); write a shorter one", file=err)
            turns.pop()
            continue
        stats = RequestStats()
        reply = []
        try:
            for ev in engine.generate(ids, params, drafter=drafter, n_max=n_max, n_min=n_min, stats=stats,
                                      images=spans):
                reply.append(ev.text)
                out.write(ev.text)
                out.flush()
        except KeyboardInterrupt:
            out.write("\n")
            out.flush()
            print(f"(reply stopped after {stats.generated_tokens} tokens)", file=err)
        else:
            out.write("\n")
            out.flush()
            print(stats_line(stats), file=err)
            if spec:
                print(stats.spec.llama_line(), file=err)
                for line in stats.spec.drafter_lines():
                    print(line, file=err)
        turns.append({"role": "assistant", "content": "".join(reply)})


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``chat`` on the ``gemmaspec`` subparsers."""
    from .generate import add_verbose

    c = sub.add_parser("chat", help="a conversation in the terminal (llama-cli's -cnv), streamed", allow_abbrev=False)
    add_common(c)
    add_sampling(c, 512, "most tokens per reply (-1: until the end of the turn or the context; default 512)")
    c.add_argument("-sys", "--system-prompt", default=None, help="system message at the head of the conversation")
    c.add_argument("-cnv", "--conversation", action="store_true", help=argparse.SUPPRESS)  # what chat is anyway
    c.add_argument("--mmproj", default=None, metavar="FILE",
                   help="the model's vision projector (mmproj GGUF or multimodal checkpoint directory): then "
                        "'/image FILE' attaches an image to the next message")
    add_verbose(c)
    add_spec(c)
    return c


def run(args) -> int:
    """``gemmaspec chat``. Returns the exit status (0)."""
    from .generate import announce, load, note_if_base

    params = sampling_params(args)
    engine, drafter, plan, _, memory_line = load(args)
    announce(args, plan, memory_line)
    note_if_base(engine)
    from .images import load_projector

    vision = load_projector(args.mmproj, engine) if args.mmproj else None
    return run_chat(engine, drafter, params, n_max=plan.spec.n_max, n_min=plan.spec.n_min, system=args.system_prompt,
                    spec=plan.spec_type != "none", vision=vision)
