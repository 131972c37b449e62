"""The ``gemmaspec`` command.

``gemmaspec generate`` streams generated text (never the prompt) to stdout and writes one stats line
(and, with speculation, llama-server's acceptance line) to stderr. ``gemmaspec inspect MODEL`` prints
what a model file holds. ``gemmaspec serve`` runs the OpenAI-compatible HTTP server
(:mod:`gemmaspec.server`). Errors are one line on stderr and exit status 1; usage errors exit 2.
Flags follow llama.cpp's ``llama-cli`` / ``llama-server``.
"""

from __future__ import annotations

import argparse
import sys
import time

from .errors import GemmaspecError, InputError


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="GGUF model file (default: the embedded Gemma 3 270M)")
    p.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="context size in tokens (0 = the model's; default 4096 or the model's, if smaller)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run (default auto)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")


def _add_spec(p: argparse.ArgumentParser, default: str | None = "none", help_default: str = "default none") -> None:
    sp = p.add_argument_group("speculative decoding (llama-server's flags)")
    sp.add_argument("--spec-type", default=default, choices=["none", "ngram-simple", "draft-simple", "draft-mtp"],
                    help=f"drafter ({help_default})")
    sp.add_argument("--spec-draft-n-max", "--draft-max", default="3",
                    help="most draft tokens per round, or 'auto' to adapt per request (default 3)")
    sp.add_argument("--spec-draft-n-min", "--draft-min", type=int, default=0,
                    help="proposals shorter than this are not verified (default 0)")
    sp.add_argument("--spec-draft-p-min", "--draft-p-min", type=float, default=0.0,
                    help="draft model stops drafting below this top probability (default 0)")
    sp.add_argument("-md", "--model-draft", default=None, help="draft model GGUF for --spec-type draft-simple")
    sp.add_argument("--spec-ngram-size", type=int, default=4, help="longest n-gram to match (default 4)")
    sp.add_argument("--spec-ngram-min", type=int, default=1, help="shortest n-gram that counts (default 1)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gemmaspec", description="Gemma models with speculative decoding.")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    _add_common(g)
    g.add_argument("-p", "--prompt", required=True, help="the prompt text ('-' reads standard input)")
    g.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (-1: until a stop; default 128)")
    g.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="top-k, 0 = off (default 40)")
    g.add_argument("--top-p", type=float, default=0.95, help="top-p, 1 = off (default 0.95)")
    g.add_argument("--min-p", type=float, default=0.05, help="min-p, 0 = off (default 0.05)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="repetition penalty, 1 = off (default 1.0)")
    g.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalty looks back over (default 64)")
    g.add_argument("-s", "--seed", type=int, default=-1, help="random seed, -1 = random (default -1)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("-sys", "--system-prompt", default=None, help="system message for --chat")

    _add_spec(g)

    from .server.main import add_serve_parser

    add_serve_parser(sub, _add_common, _add_spec)

    i = sub.add_parser("inspect", help="print a model file's architecture, config and tensor types")
    i.add_argument("model", help="GGUF model file")

    cv = sub.add_parser("convert", help="write a Gemma 4 checkpoint directory (target or assistant) as GGUF")
    cv.add_argument("hf_dir", help="Hugging Face checkpoint directory")
    cv.add_argument("out", help="output .gguf")
    cv.add_argument("--outtype", default="bf16", choices=["f32", "f16", "bf16", "q8_0"],
                    help="type of the 2-D weights (norms and scales stay f32; default bf16)")
    cv.add_argument("--force", action="store_true", help="overwrite OUT if it exists")

    q = sub.add_parser("quantize", help="pack a QAT checkpoint as exact Q4_0 GGUF (no re-rounding), with a report")
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

    v = sub.add_parser("verify", help="check a quantized GGUF against its source, tensor by tensor (exit 0/1)")
    v.add_argument("out", metavar="OUT.gguf", help="the file written by gemmaspec quantize")
    v.add_argument("--against", metavar="IN", required=True, help="the source it was made from")
    return ap


def _cmd_generate(args) -> int:
    from .loader import load_drafter, load_engine
    from .engine import RequestStats
    from .sampling import SamplingParams

    params = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                            max_tokens=args.n_predict, seed=args.seed, stop=tuple(s for s in args.stop if s),
                            ignore_eos=args.ignore_eos).validate()
    n_max = _parse_n_max(args.spec_draft_n_max)
    if args.spec_draft_n_min < 0:
        raise InputError(f"--spec-draft-n-min must be >= 0 (got {args.spec_draft_n_min})")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    t0 = time.perf_counter()
    engine = load_engine(args.model, ctx_size=args.ctx_size, device=args.device, threads=args.threads)
    load_s = time.perf_counter() - t0
    drafter = load_drafter(args.spec_type, engine, args.model_draft, args.spec_draft_p_min,
                           args.spec_ngram_size, args.spec_ngram_min)
    ids = engine.encode_prompt(prompt, chat=args.chat, system=args.system_prompt)
    engine.check_prompt(ids)
    stats = RequestStats()
    out = sys.stdout
    for ev in engine.generate(ids, params, drafter=drafter, n_max=n_max, n_min=args.spec_draft_n_min, stats=stats):
        out.write(ev.text)
        out.flush()
    out.write("\n")
    out.flush()
    print(f"load {load_s:.2f} s | {stats.line()}", file=sys.stderr)
    if args.spec_type != "none":
        print(stats.spec.llama_line(), file=sys.stderr)
    return 0


def _parse_n_max(value: str):
    from .errors import InputError

    if value == "auto":
        return "auto"
    try:
        n = int(value)
    except ValueError:
        raise InputError(f"--spec-draft-n-max must be a number or 'auto' (got {value})") from None
    if not 0 <= n <= 15:
        raise InputError(f"--spec-draft-n-max must be in 0..15 or 'auto' (got {n})")
    return n


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
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "convert":
            return _cmd_convert(args)
        if args.command == "serve":
            from .server.main import serve

            return serve(args)
        if args.command == "quantize":
            return _cmd_quantize(args)
        if args.command == "verify":
            return _cmd_verify(args)
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
