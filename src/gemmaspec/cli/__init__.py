"""The ``gemmaspec`` command: every front end, one module per command family.

- :mod:`.generate` (``generate``), :mod:`.chat` (``chat``), :mod:`.serve` (``serve``, the HTTP server
  of :mod:`gemmaspec.server`), :mod:`.bench` (``bench``), :mod:`.models` (``pull``, ``models``,
  ``fit``, ``inspect``), :mod:`.export` (``export``), :mod:`.files` (``convert``, ``quantize``,
  ``verify``), :mod:`.train` (``train-drafter``, ``eval-drafter``);
- :mod:`.args`: the flags they share and the one place flags become settings (sampling, speculation).

Argument parsing lives only in this package. Errors are one line on stderr (``error: ...``) and exit
status 1; usage errors exit 2.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import GemmaspecError
from . import bench, chat, export, files, generate, models, serve, train
from .args import Parser, check_common, setup_logging


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__

    try:
        return f"gemmaspec {version('gemmaspec')}"
    except PackageNotFoundError:
        return f"gemmaspec {__version__}"


def build_parser() -> argparse.ArgumentParser:
    """The ``gemmaspec`` parser with every subcommand."""
    ap = Parser(prog="gemmaspec", description="Gemma models with speculative decoding.", allow_abbrev=False)
    ap.add_argument("--version", action="version", version=_version())
    sub = ap.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    chat.add_parser(sub)
    serve.add_parser(sub)
    files.add_parsers(sub)
    train.add_parsers(sub)
    models.add_parsers(sub)
    export.add_parser(sub)
    bench.add_parser(sub)
    return ap


COMMANDS = {"generate": generate.run, "chat": chat.run, "serve": serve.serve, "export": export.run,
            "bench": bench.run, "train-drafter": train.run_train, "eval-drafter": train.run_eval,
            **files.COMMANDS, **models.COMMANDS}
"""Subcommand name -> its function (parsed args -> exit status)."""


def main(argv=None) -> int:
    """Run ``gemmaspec`` with ``argv`` (default ``sys.argv[1:]``). Returns the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand in the error, as for every other bad flag of it
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    setup_logging()
    try:
        check_common(args)
        return COMMANDS[args.command](args)
    except GemmaspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
