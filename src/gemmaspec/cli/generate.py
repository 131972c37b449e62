"""``gemmaspec generate``: one prompt, the generated text (never the prompt) streamed to stdout.

stderr gets the speculation line (which drafter, draft length; ``--verbose`` adds why it is the
default and the memory estimate), then after the text one stats line and, with speculation,
llama-server's acceptance line and one line per drafter; ``--json`` adds the stats as one JSON line, the
last on stdout. ``--compare`` decodes the prompt plainly and then with speculation (:mod:`.compare`).
Also :func:`load`, shared with ``chat``: the settings checked and the memory estimated before anything
is loaded, then the engine and the drafter.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..errors import InputError
from .args import (add_common, add_sampling, add_spec, memory_estimate, refuse, sampling_params,
                   spec_plan)
from .images import add_image_flags, image_prompt_ids

CHAT_HINT = "gemmaspec generate answers one prompt; for a conversation use `gemmaspec chat`"

LLAMA_FLAGS_REFUSED_GENERATE = {
    ("-cnv", "--conversation", "-i", "--interactive", "-if", "--interactive-first"): CHAT_HINT,
}


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``generate`` on the ``gemmaspec`` subparsers."""
    g = sub.add_parser("generate", help="generate text from a prompt", allow_abbrev=False)
    add_common(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="the prompt text ('-' reads standard input)")
    src.add_argument("-f", "--file", help="read the prompt from this file")
    add_sampling(g, 128, "tokens to generate (-1: until a stop; default 128)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("-sys", "--system-prompt", default=None, help="system message for --chat")
    g.add_argument("--json", action="store_true",
                   help="after the text, print the stats as one JSON line on stdout (the last line)")
    g.add_argument("--compare", action="store_true",
                   help="decode the prompt plainly, then with speculation (one seed): both speeds, the speedup, "
                        "and whether the two texts are identical (they must be; exit status 1 if not)")
    add_image_flags(g)
    add_verbose(g)
    refuse(g, LLAMA_FLAGS_REFUSED_GENERATE)
    add_spec(g)
    return g


def add_verbose(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also say why the default speculation was chosen (the measurement behind it) and the "
                        "memory estimate (a setup that does not fit is refused with its numbers either way)")


def load(args):
    """Plan the drafter, estimate the memory (a setup that does not fit is refused before loading),
    then load the engine and the drafter. The caller prints :func:`announce` once the request is
    accepted (a refused prompt gets its one error line only).

    Returns:
        ``(engine, drafter, plan, load_s, memory_line)``: load time in seconds (the engine's); the
        estimate's line, or None where none was made.

    Raises:
        GemmaspecError: bad flags, a setup that does not fit, an unreadable or mismatched model.
    """
    from ..heap import startup_heap
    from ..loading.engine import load_engine
    from ..speculative.plan import build

    with startup_heap():
        plan = spec_plan(args)
        est = memory_estimate(args, plan)
        t0 = time.perf_counter()
        engine = load_engine(args.model, ctx_size=args.ctx_size, device=args.device, threads=args.threads)
        load_s = time.perf_counter() - t0
        drafter = build(plan, engine, warn=lambda line: print(line, file=sys.stderr))(engine.cache)
    return engine, drafter, plan, load_s, (est.line() if est is not None else None)


def announce(args, plan, memory_line: str | None) -> None:
    """On stderr: the speculation line (which drafter, n-max, file); with ``--verbose`` also the reason
    for a shipped default and the memory estimate's line (when one was made)."""
    print(plan.line(), file=sys.stderr)
    if getattr(args, "verbose", False):
        if plan.why:
            print(f"  why: {plan.why}", file=sys.stderr)
        if memory_line:
            print(memory_line, file=sys.stderr)


def note_if_base(engine) -> None:
    """On stderr, before a chat: a plain note when the model is a base model (no chat template in its
    file), naming the instruction-tuned models to use instead."""
    from ..manage.catalog import base_model_note, is_base

    if is_base(engine.tokenizer):
        print(f"note: {base_model_note()}", file=sys.stderr)


def read_prompt(args) -> str:
    """The prompt of ``-p`` (``-`` reads stdin) or ``-f``.

    Raises:
        InputError: an unreadable or non-UTF-8 prompt file.
    """
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as f:
                return f.read()
        except OSError as exc:
            raise InputError(f"cannot read the prompt file {args.file}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise InputError(f"the prompt file {args.file} is not UTF-8 text") from None
    return sys.stdin.read() if args.prompt == "-" else args.prompt


def run(args) -> int:
    """``gemmaspec generate``. Returns the exit status (0)."""
    from ..engine import RequestStats
    from ..report import stats_line, stats_record

    params = sampling_params(args)
    prompt = read_prompt(args)
    if args.compare:
        from . import compare

        compare.check(args)
    engine, drafter, plan, load_s, memory_line = load(args)
    with_images = image_prompt_ids(args, engine, prompt)
    ids, spans = with_images or (engine.encode_prompt(prompt, chat=args.chat, system=args.system_prompt), [])
    if not args.context_shift:
        engine.check_prompt(ids)
    announce(args, plan, memory_line)
    if args.chat:
        note_if_base(engine)
    if args.compare:
        return compare.run(args, engine, drafter, plan, load_s, ids, params)
    stats = RequestStats()
    out = sys.stdout
    n_max = plan.spec.n_max
    for ev in engine.generate(ids, params, drafter=drafter, stats=stats, n_max=n_max, n_min=plan.spec.n_min,
                              context_shift=args.context_shift, n_keep=args.keep, images=spans):
        out.write(ev.text)
        out.flush()
    out.write("\n")
    if args.json:
        used = plan.spec_type
        out.write(json.dumps(stats_record(stats, load_s, used, n_max if used != "none" else 0)) + "\n")
    out.flush()
    print(stats_line(stats, load_s), file=sys.stderr)
    if plan.spec_type != "none":
        print(stats.spec.llama_line(), file=sys.stderr)
        for line in stats.spec.drafter_lines():
            print(line, file=sys.stderr)
    return 0
