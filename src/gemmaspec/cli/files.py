"""File commands: ``convert`` (a checkpoint directory to GGUF), ``quantize --exact`` (exact Q4_0) and
``verify`` (a quantized file against its source)."""

from __future__ import annotations

import sys
import time


def add_parsers(sub) -> None:
    """Register ``convert``, ``quantize`` and ``verify`` on the ``gemmaspec`` subparsers."""
    cv = sub.add_parser("convert", help="write a Gemma 4 checkpoint directory (target or assistant) as GGUF",
                        allow_abbrev=False)
    cv.add_argument("hf_dir", help="Hugging Face checkpoint directory")
    cv.add_argument("out", help="output .gguf")
    cv.add_argument("--outtype", default="bf16", choices=["f32", "f16", "bf16", "q8_0"],
                    help="type of the 2-D weights (norms and scales stay f32; default bf16)")
    cv.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    cv.add_argument("--mmproj", action="store_true",
                    help="write the checkpoint's vision tower as an mmproj GGUF instead (Gemma 3, Gemma 4; "
                         "llama.cpp's convert_hf_to_gguf.py --mmproj, loads in llama-mtmd-cli): F16 matrices, or "
                         "F32 with --outtype f32")

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

    v = sub.add_parser("verify", help="check a quantized GGUF against its source, tensor by tensor (exit 0/1)",
                       allow_abbrev=False)
    v.add_argument("out", metavar="OUT.gguf", help="the file written by gemmaspec quantize")
    v.add_argument("--against", metavar="IN", required=True, help="the source it was made from")


def run_convert(args) -> int:
    """``gemmaspec convert HF_DIR OUT.gguf``."""
    from ..loading.convert import convert

    t0 = time.perf_counter()
    if args.mmproj:
        from ..loading.vision import load_vision, write_mmproj

        write_mmproj(args.hf_dir, args.out, force=args.force, outtype="f32" if args.outtype == "f32" else "f16")
        v = load_vision(args.out)
        print(f"wrote {args.out}: mmproj ({v.arch.name} projector), {v.config.num_layers} encoder layers, "
              f"{'up to ' if getattr(v.config, 'preprocessing', '') == 'patches' else ''}"
              f"{v.model.tokens_per_image} tokens per image, in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        return 0
    info = convert(args.hf_dir, args.out, args.outtype, force=args.force)
    types = ", ".join(f"{n} {k}" for k, n in sorted(info["types"].items()))
    print(f"wrote {args.out}: arch {info['arch']}, {info['tensors']} tensors ({types}), "
          f"{info['bytes'] / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def run_quantize(args) -> int:
    """``gemmaspec quantize IN OUT.gguf --exact``, with its report on stderr."""
    from ..quant.quantize import quantize_exact
    from ..quant.report import format_size, write_report

    rep = quantize_exact(args.src, args.out, args.fallback, strict=args.strict, force=args.force,
                         compare_all=args.compare_all, threads=args.threads)
    print(rep.table(per_tensor=args.verbose or len(rep.tensors) <= 60), file=sys.stderr)
    if args.report:
        write_report(rep, args.report)
    print(f"wrote {args.out}: {format_size(rep.output_bytes)} in {rep.seconds:.2f} s "
          f"({rep.source_bytes / 1e6 / max(rep.seconds, 1e-9):.0f} MB/s of source)", file=sys.stderr)
    return 0


def run_verify(args) -> int:
    """``gemmaspec verify OUT.gguf --against IN``: exit status 0 when every tensor checks, else 1."""
    from ..quant.check import check_against_source

    res = check_against_source(args.out, args.against)
    types = ", ".join(f"{n} {k}" for k, n in sorted(res.by_type.items()))
    for f in res.failures:
        print(f"FAIL {f}", file=sys.stderr)
    verdict = "OK" if res.ok else f"FAILED ({len(res.failures)} problems)"
    print(f"{verdict}: {res.checked} tensors checked ({types}); Q4_0 worst {res.worst_ulp_q4_0:.2f} ulp of the source "
          "(bound 1.0); other types equal the source's encoding", file=sys.stderr)
    return 0 if res.ok else 1


COMMANDS = {"convert": run_convert, "quantize": run_quantize, "verify": run_verify}
