"""The ``gemmaspec`` command.

``gemmaspec generate`` streams generated text (never the prompt) to stdout and writes one stats line
(and, with speculation, llama-server's acceptance line) to stderr; with ``--json`` a last stdout line
holds the stats as JSON. ``gemmaspec chat`` is a conversation in the terminal (:mod:`gemmaspec.chat`).
``gemmaspec inspect MODEL`` prints what a model file holds. ``gemmaspec serve`` runs the
OpenAI-compatible HTTP server (:mod:`gemmaspec.server`). Errors are one line on stderr and exit status
1; usage errors exit 2.

Flags follow llama.cpp's ``llama-cli`` / ``llama-server``; abbreviations of long flags are refused
(``-n`` is never taken for ``-np``). llama.cpp flags that do not apply here are refused by name with
a hint (:data:`LLAMA_FLAGS_REFUSED`); ``-ngl`` is accepted and explained.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .errors import GemmaspecError, InputError
from .seeds import seed_arg
from .speculative.options import SPEC_TYPES, parse_n_max, parse_spec_type

_CHAT_HINT = "gemmaspec generate answers one prompt; for a conversation use `gemmaspec chat`"

LLAMA_FLAGS_REFUSED = {
    # llama.cpp flag(s): why it does not apply here / what to use instead
    ("-fa", "--flash-attn"): "gemmaspec has one attention implementation; there is nothing to switch",
    ("--mlock", "--no-mmap", "--mmap"): "gemmaspec reads the weights into memory (no memory map); nothing to set",
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

LLAMA_FLAGS_REFUSED_GENERATE = {
    ("-cnv", "--conversation", "-i", "--interactive", "-if", "--interactive-first"): _CHAT_HINT,
}

LLAMA_FLAGS_REFUSED_SERVE = {
    ("-cb", "--cont-batching", "-nocb", "--no-cont-batching"): "the -np slots are always batched together",
}


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose ``allow_abbrev=False`` also covers single-dash flags: Python 3.11's
    argparse still takes ``-n`` for ``-np`` (a prefix of a multi-letter single-dash flag). A short
    flag glued to its value (``-n64``) still works."""

    def _get_option_tuples(self, option_string):
        found = super()._get_option_tuples(option_string)
        if self.allow_abbrev or option_string[1:2] in self.prefix_chars:
            return found
        return [t for t in found if t[1] == option_string[:2]]


class _Refused(argparse.Action):
    """A llama.cpp flag that does not apply: parsing it is an error naming the flag, with a hint."""

    def __init__(self, option_strings, dest, hint: str = "", **kw):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} (llama.cpp's) does not apply to gemmaspec: {self.hint}")


def _refuse(p: argparse.ArgumentParser, table: dict) -> None:
    for flags, hint in table.items():
        p.add_argument(*flags, action=_Refused, hint=hint)


def _add_common(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--act-quant", default=None, choices=["none", "q8_0"],
                   help="activations of the CPU kernel's decode/verify products: none = fp32 (default; matches "
                        "transformers to ~1e-6), q8_0 = int8 per 32 values with integer dot products, llama.cpp's "
                        "CPU numerics (faster where the fp32 products are compute-bound; env GEMMASPEC_ACT_QUANT)")
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="gpu_layers", default=None, metavar="N",
                   help="accepted for llama.cpp compatibility and ignored: the whole model runs on --device")
    _refuse(p, LLAMA_FLAGS_REFUSED)


def _spec_type_arg(value: str) -> str:
    """argparse ``type`` of ``--spec-type``: the canonical spelling, or argparse's usage error."""
    try:
        return parse_spec_type(value)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_spec(p: argparse.ArgumentParser, default: str | None = "none", help_default: str = "default none") -> None:
    sp = p.add_argument_group("speculative decoding (llama-server's flags)")
    sp.add_argument("--spec-type", default=None, type=_spec_type_arg, metavar="TYPE[,TYPE]",
                    help=f"drafter: {', '.join(SPEC_TYPES)}, or n-gram lookup with a model type, e.g. "
                         f"ngram-simple,draft-mtp (n-gram drafts where it finds a match, the assistant elsewhere, "
                         f"as llama.cpp's comma-separated list) ({help_default}; with -md and no --spec-type: "
                         "draft-mtp for an assistant, draft-simple for a model, as llama.cpp)")
    p.set_defaults(spec_type_default=default)
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


def _add_sampling(p: argparse.ArgumentParser, n_default: int, n_help: str) -> None:
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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    try:
        return f"gemmaspec {version('gemmaspec')}"
    except PackageNotFoundError:
        return f"gemmaspec {__version__}"


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="gemmaspec", description="Gemma models with speculative decoding.",
                                 allow_abbrev=False)
    ap.add_argument("--version", action="version", version=_version())
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt", allow_abbrev=False)
    _add_common(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="the prompt text ('-' reads standard input)")
    src.add_argument("-f", "--file", help="read the prompt from this file")
    _add_sampling(g, 128, "tokens to generate (-1: until a stop; default 128)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("-sys", "--system-prompt", default=None, help="system message for --chat")
    g.add_argument("--json", action="store_true",
                   help="after the text, print the stats as one JSON line on stdout (the last line)")
    _refuse(g, LLAMA_FLAGS_REFUSED_GENERATE)
    _add_spec(g)

    c = sub.add_parser("chat", help="a conversation in the terminal (llama-cli's -cnv), streamed", allow_abbrev=False)
    _add_common(c)
    _add_sampling(c, 512, "most tokens per reply (-1: until the end of the turn or the context; default 512)")
    c.add_argument("-sys", "--system-prompt", default=None, help="system message at the head of the conversation")
    c.add_argument("-cnv", "--conversation", action="store_true", help=argparse.SUPPRESS)  # what chat is anyway
    _add_spec(c)

    from .server.main import add_serve_parser

    _refuse(add_serve_parser(sub, _add_common, _add_spec), LLAMA_FLAGS_REFUSED_SERVE)

    i = sub.add_parser("inspect", help="print a model file's architecture, config and tensor types", allow_abbrev=False)
    i.add_argument("model", help="GGUF model file")

    cv = sub.add_parser("convert", help="write a Gemma 4 checkpoint directory (target or assistant) as GGUF",
                        allow_abbrev=False)
    cv.add_argument("hf_dir", help="Hugging Face checkpoint directory")
    cv.add_argument("out", help="output .gguf")
    cv.add_argument("--outtype", default="bf16", choices=["f32", "f16", "bf16", "q8_0"],
                    help="type of the 2-D weights (norms and scales stay f32; default bf16)")
    cv.add_argument("--force", action="store_true", help="overwrite OUT if it exists")

    q = sub.add_parser("quantize", help="pack a QAT checkpoint as exact Q4_0 GGUF (no re-rounding), with a report",
                       allow_abbrev=False)
    q.add_argument("src", metavar="IN", help="GGUF with BF16/F16/F32 tensors, or a Gemma 4 Hugging Face directory")
    q.add_argument("out", metavar="OUT.gguf", help="output GGUF")
    q.add_argument("--exact", action="store_true", required=True,
                   help="recover each block's trained 4-bit grid (the only mode; required, so the intent is explicit)")
    q.add_argument("--fallback", default="q8_0", choices=["q8_0", "f16", "bf16", "f32"],
                   help="type of 2-D weights that fit no 4-bit grid (default q8_0, as llama.cpp stores drafters)")
    q.add_argument("--strict", action="store_true", help="an off-grid block in a 2-D weight is an error, not a fallback")
    q.add_argument("--report", metavar="REPORT.json", default=None, help="also write the report as JSON")
    q.add_argument("--compare-all", action="store_true",
                   help="measure the Q8_0 / amax-Q4_0 comparison on every row (default: every 16th row of large tensors)")
    q.add_argument("-v", "--verbose", action="store_true", help="print the per-tensor table even for large models")
    q.add_argument("-t", "--threads", type=int, default=None, help="threads for packing (all cores)")
    q.add_argument("--force", action="store_true", help="overwrite OUT if it exists")

    from .training.cli import add_parsers as _training_parsers

    _training_parsers(sub)
    _add_models_parsers(sub)

    from .bench.cli import add_parser as _bench_parser

    _bench_parser(sub)
    v = sub.add_parser("verify", help="check a quantized GGUF against its source, tensor by tensor (exit 0/1)",
                       allow_abbrev=False)
    v.add_argument("out", metavar="OUT.gguf", help="the file written by gemmaspec quantize")
    v.add_argument("--against", metavar="IN", required=True, help="the source it was made from")
    return ap


def _add_models_parsers(sub) -> None:
    """``pull``, ``models``, ``fit``, ``export``."""
    pl = sub.add_parser("pull", help="download a known model or REPO[:FILE] from the Hugging Face Hub, sha256-checked",
                        allow_abbrev=False)
    pl.add_argument("spec", metavar="NAME|REPO[:FILE]", help="a name from gemmaspec models, a repo, or repo:file")
    pl.add_argument("--revision", default=None, help="branch, tag or commit to pin (default main)")
    pl.add_argument("--sha256", default=None, help="expected sha256 of the file; a mismatch deletes the download")
    pl.add_argument("--with-assistant", action="store_true",
                    help="also fetch the target's assistant (a QAT target gets its QAT assistant)")

    sub.add_parser("models", help="list the known models (targets, assistants), their pairs and what is cached",
                   allow_abbrev=False)

    f = sub.add_parser("fit", help="will it fit? memory of a model, its drafter and KV cache, from metadata only",
                       allow_abbrev=False)
    f.add_argument("-m", "--model", default=None, help="model file, directory or known name (default: the embedded one)")
    f.add_argument("-md", "--model-draft", default=None, help="assistant or draft model")
    f.add_argument("-c", "--ctx-size", type=int, default=None, help="context per slot (0 = the model's; default 4096 "
                   "or the model's, if smaller)")
    f.add_argument("-np", "--parallel", type=int, default=1, help="slots (sequences served at once; default 1)")
    f.add_argument("--device", default="auto",
                   help="cpu, cuda (their free memory), auto, or a memory size to check against (e.g. 8GiB, 512M)")

    from .export import add_export_parser

    add_export_parser(sub)


def check_common(args) -> None:
    """Checks and notes shared by the commands that load a model (``-c``, ``-ngl``).

    Raises:
        InputError: ``-c`` negative or 1 (0 means the model's context).
    """
    if getattr(args, "spec_type_default", None) is not None and args.spec_type is None and not args.model_draft:
        args.spec_type = args.spec_type_default  # with -md and no --spec-type, None: the loader picks by the file
    ctx = getattr(args, "ctx_size", None)
    if ctx is not None and (ctx < 0 or ctx == 1):
        raise InputError(f"-c must be 0 (the model's context) or at least 2 (got {ctx})")
    if getattr(args, "act_quant", None) is not None:
        from . import kernels

        kernels.set_act_quant(args.act_quant)
    if getattr(args, "gpu_layers", None) is not None:
        print(f"note: -ngl {args.gpu_layers} ignored: gemmaspec does not split layers between devices, the whole "
              "model runs on --device (auto: CUDA when PyTorch sees a GPU, else CPU)", file=sys.stderr)


def _sampling_params(args):
    from .sampling import SamplingParams

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


def _load(args):
    """Checks the spec flags and the memory (a setup that does not fit is refused before loading),
    then loads the engine and drafter: ``(engine, drafter, n_max, load_s)``; the estimate's line is
    kept in ``args.memory_line`` for :func:`_print_memory`."""
    from .heap import startup_heap

    with startup_heap():
        return _load_quietly(args)


def _load_quietly(args):
    from .loader import load_drafter, load_engine, memory_estimate, resolve_models
    from .speculative.options import check_spec_flags

    resolve_models(args)
    n_max = parse_n_max(args.spec_draft_n_max)
    check_spec_flags(args.spec_type, args.model_draft, args.spec_draft_p_min)
    if args.spec_draft_n_min < 0:
        raise InputError(f"--spec-draft-n-min must be >= 0 (got {args.spec_draft_n_min})")
    est = memory_estimate(args)
    t0 = time.perf_counter()
    engine = load_engine(args.model, ctx_size=args.ctx_size, device=args.device, threads=args.threads)
    load_s = time.perf_counter() - t0
    drafter = load_drafter(args.spec_type, engine, args.model_draft, args.spec_draft_p_min,
                           args.spec_ngram_size, args.spec_ngram_min)
    args.memory_line = est.line() if est is not None else None  # printed once the request is accepted
    return engine, drafter, n_max, load_s


def _print_memory(args) -> None:
    if getattr(args, "memory_line", None):
        print(args.memory_line, file=sys.stderr)


def _read_prompt(args) -> str:
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as f:
                return f.read()
        except OSError as exc:
            raise InputError(f"cannot read the prompt file {args.file}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise InputError(f"the prompt file {args.file} is not UTF-8 text") from None
    return sys.stdin.read() if args.prompt == "-" else args.prompt


def _cmd_generate(args) -> int:
    from .engine import RequestStats
    from .report import stats_line, stats_record

    params = _sampling_params(args)
    prompt = _read_prompt(args)
    engine, drafter, n_max, load_s = _load(args)
    ids = engine.encode_prompt(prompt, chat=args.chat, system=args.system_prompt)
    if not args.context_shift:
        engine.check_prompt(ids)
    _print_memory(args)
    stats = RequestStats()
    out = sys.stdout
    for ev in engine.generate(ids, params, drafter=drafter, n_max=n_max, n_min=args.spec_draft_n_min, stats=stats,
                              context_shift=args.context_shift, n_keep=args.keep):
        out.write(ev.text)
        out.flush()
    out.write("\n")
    if args.json:
        used = getattr(drafter, "name", args.spec_type)  # what ran: "default" and -md resolved to their types
        out.write(json.dumps(stats_record(stats, load_s, used, n_max if used != "none" else 0)) + "\n")
    out.flush()
    print(stats_line(stats, load_s), file=sys.stderr)
    if args.spec_type != "none":
        print(stats.spec.llama_line(), file=sys.stderr)
        for line in stats.spec.drafter_lines():
            print(line, file=sys.stderr)
    return 0


def _cmd_chat(args) -> int:
    from .chat import run_chat

    params = _sampling_params(args)
    engine, drafter, n_max, _ = _load(args)
    _print_memory(args)
    if args.model is None:
        print("note: the default model (Gemma 3 270M) is a base model: it continues text and only half follows a "
              "conversation; for real answers pass -m with an instruction-tuned Gemma GGUF", file=sys.stderr)
    return run_chat(engine, drafter, params, n_max=n_max, n_min=args.spec_draft_n_min, system=args.system_prompt,
                    spec=args.spec_type != "none")


def _cmd_inspect(args) -> int:
    from .loading.inspect import describe_gguf

    print(describe_gguf(args.model))
    return 0


def _cmd_convert(args) -> int:
    from .loading.convert import convert

    t0 = time.perf_counter()
    info = convert(args.hf_dir, args.out, args.outtype, force=args.force)
    types = ", ".join(f"{n} {k}" for k, n in sorted(info["types"].items()))
    print(f"wrote {args.out}: arch {info['arch']}, {info['tensors']} tensors ({types}), "
          f"{info['bytes'] / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def _cmd_quantize(args) -> int:
    from .quant.quantize import quantize_exact
    from .quant.report import format_size, write_report

    rep = quantize_exact(args.src, args.out, args.fallback, strict=args.strict, force=args.force,
                         compare_all=args.compare_all, threads=args.threads)
    print(rep.table(per_tensor=args.verbose or len(rep.tensors) <= 60), file=sys.stderr)
    if args.report:
        write_report(rep, args.report)
    print(f"wrote {args.out}: {format_size(rep.output_bytes)} in {rep.seconds:.2f} s "
          f"({rep.source_bytes / 1e6 / max(rep.seconds, 1e-9):.0f} MB/s of source)", file=sys.stderr)
    return 0


def _cmd_pull(args) -> int:
    from .loading.hub import pull

    for p in pull(args.spec, revision=args.revision, sha256=args.sha256, with_assistant=args.with_assistant):
        print(f"{p.label}: {p.path}" + (f" (sha256 {p.sha256})" if p.sha256 else ""))
    return 0


def _cmd_models(args) -> int:
    from .loading import catalog
    from .loading.hub import cached_path

    print(f"{'name':<44} {'role':<9} {'qat':<3} {'n_max':>5}  {'cached':<6} repo / pair")
    for e in catalog.entries():
        try:
            where = cached_path(e)
        except Exception:  # noqa: BLE001 - a listing never fails on one entry
            where = None
        partner = e.assistant if e.role == "target" else e.target
        repo = e.repo or e.package or ("(placeholder)" if e.placeholder else "(repo not recorded)")
        if e.file:
            repo += f":{e.file}"
        n = "" if e.draft_n_max is None else str(e.draft_n_max)
        print(f"{e.name:<44} {e.role:<9} {'yes' if e.qat else 'no':<3} {n:>5}  {'yes' if where else 'no':<6} "
              f"{repo}" + (f"  (pair: {partner})" if partner else ""))
    print("\nn_max: the draft length used when --spec-draft-n-max is not given; sources in "
          "src/gemmaspec/loading/catalog.json")
    return 0


def _cmd_fit(args) -> int:
    from .loader import resolve_models
    from .loading.fit import device_and_free, estimate, read_model

    resolve_models(args)
    device, free = device_and_free(args.device)
    target = read_model(args.model)
    if target.role != "target":
        raise InputError(f"{target.path} is an assistant ({target.arch}); pass it as -md and its target as -m")
    est = estimate(target, read_model(args.model_draft) if args.model_draft else None, args.ctx_size,
                   args.parallel, device, free)
    print(est.table())
    return 0 if est.fits else 1


def _cmd_verify(args) -> int:
    from .quant.check import check_against_source

    res = check_against_source(args.out, args.against)
    types = ", ".join(f"{n} {k}" for k, n in sorted(res.by_type.items()))
    for f in res.failures:
        print(f"FAIL {f}", file=sys.stderr)
    verdict = "OK" if res.ok else f"FAILED ({len(res.failures)} problems)"
    print(f"{verdict}: {res.checked} tensors checked ({types}); Q4_0 worst {res.worst_ulp_q4_0:.2f} ulp of the source "
          "(bound 1.0); other types equal the source's encoding", file=sys.stderr)
    return 0 if res.ok else 1


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand in the error, as for every other bad flag of it
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        check_common(args)
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "chat":
            return _cmd_chat(args)
        if args.command == "convert":
            return _cmd_convert(args)
        if args.command == "serve":
            from .server.main import serve

            return serve(args)
        if args.command == "quantize":
            return _cmd_quantize(args)
        if args.command in ("train-drafter", "eval-drafter"):
            from .training import cli as training_cli

            return training_cli.run_train(args) if args.command == "train-drafter" else training_cli.run_eval(args)
        if args.command == "verify":
            return _cmd_verify(args)
        if args.command in ("pull", "models", "fit", "export"):
            if args.command == "export":
                from .export import cmd_export

                return cmd_export(args)
            return {"pull": _cmd_pull, "models": _cmd_models, "fit": _cmd_fit}[args.command](args)
        if args.command == "bench":
            from .bench.cli import run as run_bench

            return run_bench(args)
        return _cmd_inspect(args)
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
