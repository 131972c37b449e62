"""What the commands share: the argparse parser class, the llama.cpp flags refused by name, the
common / speculative / sampling flags, and the ONE place where flags become settings
(:func:`sampling_params`, :func:`spec_config`, :func:`resolve_models`, :func:`check_common`).

Flags follow llama.cpp's ``llama-cli`` / ``llama-server``; abbreviations of long flags are refused
(``-n`` is never taken for ``-np``). llama.cpp flags that do not apply here are refused by name with a
hint (:data:`LLAMA_FLAGS_REFUSED`); ``-ngl`` is accepted and explained.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..errors import InputError
from ..seeds import llama_seed
from ..speculative.config import SpecConfig
from ..speculative.options import SPEC_TYPES, parse_spec_type

LLAMA_FLAGS_REFUSED = {
    # llama.cpp flag(s): why it does not apply here / what to use instead
    ("-fa", "--flash-attn"): "gemmaspec has one attention implementation; there is nothing to switch",
    ("--mlock", "--no-mmap", "--mmap"): "gemmaspec always memory-maps GGUF weights (used in place, read as "
                                        "needed); there is nothing to switch",
    ("-b", "--batch-size", "-ub", "--ubatch-size"): "prompts are prefilled in chunks of 256 tokens; not configurable",
    ("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"): "the KV cache has one type (the model's float type)",
    ("-tb", "--threads-batch"): "-t sets the threads for prefill and decode alike",
    ("-sm", "--split-mode", "-ts", "--tensor-split", "-mg", "--main-gpu"):
        "gemmaspec runs the whole model on one device: --device cpu|cuda",
    ("-hf", "--hf-repo", "-mu", "--model-url"): "download with `gemmaspec pull NAME|REPO[:FILE]`, then pass -m NAME or -m FILE",
    ("--numa",): "no NUMA placement; set the thread count with -t",
    ("-co", "--color"): "output is plain text (no colors)",
    ("-r", "--reverse-prompt"): "use --stop STR (repeatable) to end generation at a string",
}
"""llama.cpp flags refused by name, each with a one-line hint (an error, exit status 2)."""


def seed_arg(text: str) -> int:
    """``--seed``'s argparse type: any integer, read as llama.cpp reads it
    (:func:`~gemmaspec.seeds.llama_seed`: wrapped to 32 bits, -1 random)."""
    return llama_seed(int(text))


seed_arg.__name__ = "seed"  # argparse's "invalid seed value: 'x'"


class Parser(argparse.ArgumentParser):
    """An argparse parser whose ``allow_abbrev=False`` also covers single-dash flags: Python 3.11's
    argparse still takes ``-n`` for ``-np`` (a prefix of a multi-letter single-dash flag). A short
    flag glued to its value (``-n64``) still works."""

    def _get_option_tuples(self, option_string):
        found = super()._get_option_tuples(option_string)
        if self.allow_abbrev or option_string[1:2] in self.prefix_chars:
            return found
        return [t for t in found if t[1] == option_string[:2]]


class _Refused(argparse.Action):
    """A llama.cpp flag that does not apply: parsing it is a one-line error naming the flag, with a hint
    (exit status 2, as argparse's; no usage text before it: the hint is what helps)."""

    def __init__(self, option_strings, dest, hint: str = "", **kw):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"{parser.prog}: error: {option_string} (llama.cpp's) does not apply here: {self.hint}\n")


def refuse(p: argparse.ArgumentParser, table: dict) -> None:
    for flags, hint in table.items():
        p.add_argument(*flags, action=_Refused, hint=hint)


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="GGUF file, Hugging Face checkpoint directory or a known model name (gemmaspec models; "
                        "default: the embedded Gemma 3 270M)")
    p.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="context size in tokens (0 = the model's; default 4096 or the model's, if smaller)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run (default auto)")
    p.add_argument("--context-shift", dest="context_shift", action="store_true", default=False,
                   help="when the context fills, drop tokens after the first --keep and go on (a prompt that "
                        "does not fit is cut the same way) instead of stopping; the cache is rebuilt from the "
                        "tokens kept, so output is exactly the model's on the shortened context")
    p.add_argument("--no-context-shift", dest="context_shift", action="store_false", help="stop at the context (default)")
    p.add_argument("--keep", type=int, default=0, metavar="N",
                   help="tokens of the prompt kept by a context shift, after BOS (-1: the whole prompt; default 0)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: the physical cores this process may use)")
    p.add_argument("--act-quant", default=None, choices=["auto", "none", "q8_0"],
                   help="activations of the CPU kernel's decode/verify products: none = fp32 (matches transformers "
                        "to ~1e-6), q8_0 = int8 per 32 values with integer dot products, llama.cpp's CPU numerics "
                        "(faster where the fp32 products are compute-bound); auto (default) = q8_0 for models whose "
                        "decode step reads >= 512 MiB of weights (Gemma 4 E2B and up), and from 64 MiB (Gemma 3 270M) "
                        "for the output head and the layer products the 8-row int8 layouts hold; else none "
                        "(env GEMMASPEC_ACT_QUANT)")
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="gpu_layers", default=None, metavar="N",
                   help="accepted for llama.cpp compatibility and ignored: the whole model runs on --device")
    refuse(p, LLAMA_FLAGS_REFUSED)


def _spec_type_arg(value: str) -> str:
    """argparse ``type`` of ``--spec-type``: the canonical spelling, or argparse's usage error."""
    try:
        return parse_spec_type(value)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_spec(p: argparse.ArgumentParser) -> None:
    """The speculative-decoding flags (llama-server's names), the same on every command that generates."""
    sp = p.add_argument_group("speculative decoding (llama-server's flags)")
    sp.add_argument("--spec-type", default=None, type=_spec_type_arg, metavar="TYPE[,TYPE]",
                    help=f"drafter: {', '.join(SPEC_TYPES)}, or n-gram lookup with a model type, e.g. "
                         "ngram-simple,draft-mtp (n-gram drafts where it finds a match, the assistant elsewhere, "
                         "as llama.cpp's comma-separated list). Default: what ships as fastest for the model (the "
                         "default model: ngram-simple,draft-mtp with its shipped assistant), else ngram-simple; "
                         "with -md: draft-mtp for an assistant, draft-simple for a model, as llama.cpp. "
                         "none turns speculation off")
    sp.add_argument("--spec-draft-n-max", "--draft-max", default=None,
                    help="most draft tokens per round, or 'auto' to adapt per request (default: the known model's "
                         "recommendation, see gemmaspec models; else 3)")
    sp.add_argument("--spec-draft-n-min", "--draft-min", type=int, default=0,
                    help="proposals shorter than this are not verified (default 0)")
    sp.add_argument("--spec-draft-p-min", "--draft-p-min", type=float, default=None,
                    help="a round's drafting (draft model or MTP assistant) stops at a draft whose probability is "
                         "below this (default 0; for an assistant gemmaspec ships, the value measured best for it)")
    sp.add_argument("-md", "--model-draft", default=None,
                    help="assistant (draft-mtp) or draft model (draft-simple): file, directory or known model name")
    sp.add_argument("--spec-ngram-size", type=int, default=4, help="longest n-gram to match (default 4)")
    sp.add_argument("--spec-ngram-min", type=int, default=1, help="shortest n-gram that counts (default 1)")
    sp.add_argument("--spec-ngram-mod-n-match", type=int, default=24,
                    help="ngram-mod: tokens hashed per entry of its shared pool (default 24, llama.cpp's)")
    sp.add_argument("--spec-ngram-mod-n-min", type=int, default=1,
                    help="ngram-mod: shortest draft proposed (default 1; llama.cpp's 48 is for 64-token drafts)")


def add_sampling(p: argparse.ArgumentParser, n_default: int, n_help: str) -> None:
    p.add_argument("-n", "--n-predict", type=int, default=n_default, help=n_help)
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k, 0 or below = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p, 1 = off (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p, 0 = off (default 0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="repetition penalty, 1 = off (default 1.0)")
    p.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalty looks back over (default 64, 0 = off, -1 = the whole context)")
    p.add_argument("-s", "--seed", type=seed_arg, default=-1,
                   help="random seed, -1 = random (default -1); any integer, wrapped to 32 bits as llama.cpp does")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="never end at EOS / end of turn: they are banned (a -inf logit bias), as llama.cpp does")




def check_common(args) -> None:
    """Checks and notes shared by the commands that load a model (``-c``, ``--act-quant``, ``-ngl``).

    Raises:
        InputError: ``-c`` negative or 1 (0 means the model's context).
    """
    ctx = getattr(args, "ctx_size", None)
    if ctx is not None and (ctx < 0 or ctx == 1):
        raise InputError(f"-c must be 0 (the model's context) or at least 2 (got {ctx})")
    if getattr(args, "act_quant", None) is not None:
        from .. import kernels

        kernels.set_act_quant(args.act_quant)
    if getattr(args, "gpu_layers", None) is not None:
        print(f"note: -ngl {args.gpu_layers} ignored: gemmaspec does not split layers between devices, the whole "
              "model runs on --device (auto: CUDA when PyTorch sees a GPU, else CPU)", file=sys.stderr)


def sampling_params(args, server: bool = False):
    """The sampling flags of ``args`` as :class:`~gemmaspec.sampling.SamplingParams`: the one builder
    for ``generate``, ``chat`` and ``serve``. For ``serve`` (``server=True``) the flags are the defaults
    of requests that leave a field out: only the flags given are set, and ``-n`` is not among them
    (each endpoint has its own default limit).

    Raises:
        InputError: ``-n 0`` (or below -1 for serve), ``--repeat-last-n`` below -1, or a value
            :meth:`SamplingParams.validate` refuses.
    """
    from ..sampling import SamplingParams

    if server:
        if args.n_predict is not None and (args.n_predict == 0 or args.n_predict < -1):
            raise InputError(f"-n must be at least 1, or -1 for no limit (got {args.n_predict})")
        top_k = None if args.top_k is None else max(args.top_k, 0)  # llama.cpp's top-k is off at k <= 0
        given = {k: v for k, v in (("temperature", args.temp), ("top_k", top_k), ("top_p", args.top_p),
                                   ("min_p", args.min_p), ("repeat_penalty", args.repeat_penalty),
                                   ("seed", args.seed)) if v is not None}
        return SamplingParams(**given).validate()
    if args.n_predict == 0:  # the library's "prompt only" has no use on the command line
        raise InputError("the number of tokens to generate must be >= 1, or -1 for no limit (got 0)")
    if args.repeat_last_n < -1:
        raise InputError(f"--repeat-last-n must be >= 0 (0 disables it), or -1 for the whole context "
                         f"(got {args.repeat_last_n})")
    # llama.cpp's -1 = ctx_size: the whole history, which never outgrows the context (a shift drops tokens)
    last_n = 1 << 31 if args.repeat_last_n == -1 else args.repeat_last_n
    return SamplingParams(temperature=args.temp, top_k=max(args.top_k, 0), top_p=args.top_p, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=last_n,
                          max_tokens=args.n_predict, seed=args.seed, stop=tuple(s for s in args.stop if s),
                          ignore_eos=args.ignore_eos).validate()


def resolve_models(args, metadata: bool = False) -> None:
    """Turn known model names in ``-m`` / ``-md`` into their cached paths and, when
    ``--spec-draft-n-max`` is not given, take the catalog's recommended draft length (else 3). The
    catalog entries go to ``args.target_entry`` / ``args.draft_entry`` (None for a plain path).

    Args:
        metadata: a name not downloaded becomes a metadata-only stand-in read from the hub
            (``fit`` and ``export``, which need no weights) instead of an error.

    Raises:
        InputError: an unknown name (close matches listed) or one not downloaded yet.
        ModelFileError: with ``metadata``, the hub unreachable or refusing (one line).
    """
    from ..manage import catalog
    from ..manage.remote import resolve

    args.model, target = resolve(args.model, metadata)
    args.target_entry = target if args.model is not None else None
    draft = None
    if getattr(args, "model_draft", None):
        args.model_draft, draft = resolve(args.model_draft, metadata)
    args.draft_entry = draft
    if hasattr(args, "spec_draft_n_max") and args.spec_draft_n_max is None:
        rec = catalog.draft_n_max(target, draft) if (draft is not None or args.spec_type in (None, "ngram-simple")) \
            else None
        args.spec_draft_n_max = str(rec[0]) if rec else "3"


def spec_config(args) -> SpecConfig:
    """The speculative flags of ``args`` (models resolved by :func:`resolve_models`) as a checked
    :class:`~gemmaspec.speculative.config.SpecConfig`.

    Raises:
        InputError: as :meth:`SpecConfig.checked`.
    """
    n_max = args.spec_draft_n_max if args.spec_draft_n_max is not None else "3"
    return SpecConfig(type=args.spec_type, draft_model=args.model_draft, n_max=n_max,
                      n_min=args.spec_draft_n_min, p_min=args.spec_draft_p_min, ngram_size=args.spec_ngram_size,
                      ngram_min=args.spec_ngram_min, ngram_mod_n_match=args.spec_ngram_mod_n_match,
                      ngram_mod_n_min=args.spec_ngram_mod_n_min).checked()


def spec_plan(args, metadata: bool = False):
    """:func:`resolve_models`, :func:`spec_config` and :func:`~gemmaspec.speculative.plan.plan` for
    ``args.model``: what the command will draft with, decided before anything is loaded.

    Raises:
        InputError / ModelFileError: as those.
    """
    from ..speculative.plan import plan

    resolve_models(args, metadata)
    return plan(spec_config(args), args.model)


def read_target(model):
    """The metadata of the target ``model`` (a resolved path; None: the default model), read before
    anything is loaded or listened on.

    Raises:
        ModelFileError: a missing or unreadable file.
        InputError: an assistant given as the target.
    """
    from ..manage.fit import read_model

    info = read_model(model)
    if info.role != "target":
        raise InputError(f"{info.path} is an assistant ({info.arch}); pass it as -md and its target as -m")
    return info


def memory_estimate(args, drafter_plan, slots: int = 1, caches: int | None = None):
    """``fit``'s estimate for ``args``' model and the drafter of ``drafter_plan`` on ``args.device``
    (refused when it does not fit), or None where it cannot be made before loading (CUDA absent, an
    assistant given as -m: loading says why).

    Raises:
        InputError: the setup does not fit (with the numbers), or a bad ``-c``.
        ModelFileError: an unreadable model file (as loading would say).
    """
    from ..manage.fit import check_memory

    return check_memory(args.model, drafter_plan.draft_file, args.ctx_size, args.device, slots, caches)


class _StderrHandler(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when a record is emitted (so captured or
    redirected stderr gets the library's notes)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def setup_logging(timestamps: bool = False) -> None:
    """The library's notes (``gemmaspec`` loggers: tokenizer cache, kernel compile, the server's log)
    on stderr at INFO: as plain lines for the commands, with the time for ``serve``. Called once per
    command; a second call only changes the format."""
    logger = logging.getLogger("gemmaspec")
    handler = next((h for h in logger.handlers if isinstance(h, _StderrHandler)), None)
    if handler is None:
        handler = _StderrHandler()
        logger.addHandler(handler)
    fmt = logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S") if timestamps \
        else logging.Formatter("%(message)s")
    handler.setFormatter(fmt)
    logger.setLevel(logging.INFO)
