"""``gemmaspec bench``: where speculation pays, by text kind, draft length and number of users.

    gemmaspec bench [-m MODEL [-md DRAFT] | --url URL [--api-key K]] [--suite default|FILE.jsonl]
                    [--spec-type ngram-simple[,draft-mtp]] [--spec-draft-n-max 0,1,2,3,4,auto]
                    [--users 1,2,4,8] [--repeats 3] [--max-tokens 128] [--temp 0] [--quick]
                    [--peer llama.cpp | --peer-url URL] --out DIR

``--quick`` is a first try: 2 prompts per kind, 1 repeat, 1 user, 64 tokens per request (each flag
given explicitly still wins).

Writes DIR/results.json (raw runs, machine, versions, sha256 of the model and drafter, settings;
rewritten after every phase), DIR/report.md and DIR/speedup.png, users.png, acceptance.png. Ctrl-C
stops after dropping the phase in flight; what finished is reported. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import InputError
from ..speculative.options import SPEC_TYPES, parse_n_max, parse_spec_type

DEFAULTS = {"prompts_per_kind": None, "repeats": 3, "users": "1,2,4,8", "max_tokens": 128}
"""What an omitted --prompts-per-kind, --repeats, --users, --max-tokens mean."""
QUICK = {"prompts_per_kind": 2, "repeats": 1, "users": "1", "max_tokens": 64}
"""What they mean with --quick: a first try in a few minutes (the first 2 prompts of each kind, one
repeat, one user, short requests); no noise spread with one repeat, so only large differences count."""


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``bench`` on the ``gemmaspec`` subparsers."""
    b = sub.add_parser("bench", help="measure where speculation pays: by text kind, draft length and users "
                                     "(in-process or any OpenAI-compatible server); tables and plots",
                       allow_abbrev=False, description=__doc__.split("\n\n")[0])
    src = b.add_argument_group("what to measure (-m, or --url)")
    src.add_argument("-m", "--model", default=None, help="GGUF model or checkpoint directory, run in this process "
                                                         "(default: the embedded Gemma 3 270M)")
    src.add_argument("-md", "--model-draft", action="append", default=[],
                     help="draft model (draft-simple) or MTP assistant (draft-mtp); may be given twice, one of each")
    src.add_argument("--url", default=None, help="an OpenAI-compatible server instead (gemmaspec serve, llama-server, "
                                                 "vLLM, SGLang), e.g. http://127.0.0.1:8080")
    src.add_argument("--api-key", default=None, help="the server's API key (sent as 'Authorization: Bearer KEY')")
    src.add_argument("--model-name", default=None, help="the 'model' field sent to the server (default: its first)")
    b.add_argument("--suite", default="default", help="'default' (shipped: 10 kinds x 10 prompts) or a JSONL file "
                                                      "(kind, prompt or messages, max_tokens)")
    b.add_argument("--kinds", default=None, help="comma-separated kinds to run (default: all in the suite)")
    b.add_argument("--prompts-per-kind", type=int, default=None,
                   help="first N prompts of each kind (default: all; --quick: 2)")
    b.add_argument("--quick", action="store_true",
                   help="a first try: --prompts-per-kind 2 --repeats 1 --users 1 --max-tokens 64 (a flag given "
                        "explicitly wins)")
    b.add_argument("--spec-type", default=None,
                   help=f"comma-separated drafters to measure ({', '.join(t for t in SPEC_TYPES if t != 'none')}; "
                        "a drafter list joined by +, e.g. ngram-simple+draft-mtp: n-gram lookup where it matches, the "
                        "assistant elsewhere; default: the -md files' types, else 'default' in-process; a label with --url)")
    b.add_argument("--spec-draft-n-max", default="0,1,2,3,4,auto,choose3",
                   help="draft lengths to sweep; 0 (no speculation, the baseline) is always run; chooseN: each round's "
                        "length chosen per slot from measured costs, up to N (the server's default); "
                        "default 0,1,2,3,4,auto,choose3")
    b.add_argument("--spec-draft-p-min", type=float, default=None,
                   help="p-min of the model drafters (draft-simple, draft-mtp; in process): a round stops at a draft "
                        "below it (default: each drafter's, 0.3 for the assistant gemmaspec ships for the default "
                        "model, else 0); the report gives the value each type ran with")
    b.add_argument("--users", default=None, help="concurrent users to sweep (default 1,2,4,8; --quick: 1)")
    b.add_argument("--repeats", type=int, default=None,
                   help="runs of each phase, configurations taking turns; the spread over repeats tells noise from "
                        "a difference (default 3; --quick: 1)")
    b.add_argument("--max-tokens", type=int, default=None, help="tokens per request, EOS ignored (a suite line's "
                                                                 "max_tokens lowers it; default 128; --quick: 64)")
    b.add_argument("--temp", type=float, default=0.0, help="temperature (default 0: greedy, lossless check on)")
    b.add_argument("--seed", type=int, default=0, help="sampling seed base (per prompt: seed + its index)")
    b.add_argument("--peer", default=None, choices=["llama.cpp"],
                   help="also run llama.cpp on the same GGUF through llama-cpp-python, alternating with ours")
    b.add_argument("--peer-url", default=None, help="also run a server at this URL (e.g. llama-server), alternating")
    b.add_argument("--peer-api-key", default=None)
    b.add_argument("-c", "--ctx-size", type=int, default=None, help="context per slot in-process (default: enough "
                                                                     "for the longest prompt + --max-tokens)")
    b.add_argument("-t", "--threads", type=int, default=None, help="CPU threads in-process (default: physical cores)")
    b.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="in-process device (default auto: CUDA when PyTorch sees a GPU)")
    b.add_argument("--out", required=True, help="directory for results.json, report.md and the plots")
    b.add_argument("--label", default=None, help="a line shown at the top of report.md (e.g. 'smoke run')")
    b.add_argument("--report-only", action="store_true", help="redraw report.md and the plots from OUT/results.json")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    return b


def _int_list(value: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{flag} must be comma-separated integers (got {value!r})") from None
    if not out or any(x < 1 for x in out):
        raise InputError(f"{flag} must list integers >= 1 (got {value!r})")
    return sorted(dict.fromkeys(out))


def _n_value(text: str):
    """One ``--spec-draft-n-max`` entry: a length, ``auto``, or ``chooseN`` (``choose``: choose3).

    Raises:
        InputError: anything else.
    """
    if text.startswith("choose"):
        bound = parse_n_max(text[6:] or "3", "--spec-draft-n-max chooseN")
        if bound in (0, "auto"):
            raise InputError(f"--spec-draft-n-max: chooseN needs a bound N of 1 or more (got {text})")
        return f"choose{bound}"
    return parse_n_max(text)


def parse_settings(args) -> dict:
    """Checks the flags; returns the normalised settings.

    Raises:
        InputError: a bad value, -m with --url, an unknown spec type.
    """
    if args.url and (args.model or args.model_draft):
        raise InputError("give -m/-md (run in this process) or --url (a running server), not both")
    preset = QUICK if getattr(args, "quick", False) else DEFAULTS
    given = {k: getattr(args, k, None) for k in DEFAULTS}
    opt = {k: preset[k] if v is None else v for k, v in given.items()}
    if opt["repeats"] < 1:
        raise InputError(f"--repeats must be at least 1 (got {opt['repeats']})")
    if opt["max_tokens"] < 2:
        raise InputError(f"--max-tokens must be at least 2 (got {opt['max_tokens']})")
    if args.temp < 0:
        raise InputError(f"--temp must be >= 0 (got {args.temp})")
    n_max = [_n_value(x.strip()) for x in args.spec_draft_n_max.split(",") if x.strip()]
    n_max = [0] + [n for n in dict.fromkeys(n_max) if n != 0]
    if args.spec_type:
        types = [t.strip() for t in args.spec_type.split(",") if t.strip()]
    else:
        types = ["server"] if args.url else [] if args.model_draft else ["default"]  # []: the -md files' types
    if not args.url:
        bad = [t for t in types if t not in SPEC_TYPES and "+" not in t or t == "none"]
        if not bad:  # "ngram-simple+draft-mtp": one drafter list (generate's ngram-simple,draft-mtp)
            types = [parse_spec_type(t) for t in types]
        if bad:
            raise InputError(f"--spec-type must name drafters among {', '.join(t for t in SPEC_TYPES if t != 'none')} "
                             f"(got {', '.join(bad)}); no speculation (n-max 0) is always run")
    if args.spec_draft_p_min is not None and not 0.0 <= args.spec_draft_p_min <= 1.0:
        raise InputError(f"--spec-draft-p-min must be in [0, 1] (got {args.spec_draft_p_min})")
    if args.peer and args.peer_url:
        raise InputError("give --peer llama.cpp or --peer-url URL, not both")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()] if args.kinds else None
    return {"suite": args.suite, "kinds": kinds, "prompts_per_kind": opt["prompts_per_kind"], "spec_types": types,
            "n_max": n_max, "users": _int_list(opt["users"], "--users"), "repeats": opt["repeats"],
            "max_tokens": opt["max_tokens"], "temp": args.temp, "seed": args.seed, "url": args.url,
            "model": args.model, "model_draft": args.model_draft, "peer": args.peer, "peer_url": args.peer_url,
            "threads": args.threads, "device": args.device, "p_min": args.spec_draft_p_min,
            "quick": bool(getattr(args, "quick", False))}


def run(args) -> int:
    from ..bench.analyze import lossless, summarize
    from ..bench.report import load_results, write_report
    from ..bench.run import Config, sweep, write_json
    from ..bench.suite import load_suite
    from ..bench.targets import InProcessTarget, LlamaCppTarget, UrlTarget

    out = Path(args.out)
    if args.report_only:
        try:
            results = load_results(out)
        except (OSError, ValueError) as exc:
            raise InputError(f"cannot read {out / 'results.json'}: {exc}") from None
        if results.get("lossless") is None and (results.get("settings") or {}).get("temp") == 0:
            results["lossless"] = lossless(results, None)  # a stopped run's outputs (no margins: no model here)
        results["summary"] = summarize(results)
        write_json(out / "results.json", results)
        write_report(out, results, results["summary"])
        print(f"wrote {out / 'report.md'} and the plots", file=sys.stderr)
        return 0
    s = parse_settings(args)
    prompts = load_suite(s["suite"], s["kinds"], s["prompts_per_kind"])
    s["kinds"] = list(dict.fromkeys(p.kind for p in prompts))
    s["prompts"] = len(prompts)
    targets = []
    try:
        if s["url"]:
            ours = UrlTarget(s["url"], args.api_key, args.model_name, name="server")
        else:
            longest = max(len(p.prompt or "") + sum(len(c) + 16 for _, c in p.messages or ()) for p in prompts)
            ctx = args.ctx_size or -(-(longest + s["max_tokens"] + 96) // 256) * 256
            ours = InProcessTarget(s["model"], s["model_draft"], s["spec_types"], max(s["users"]), ctx,
                                   s["threads"], s["device"], p_min=s.get("p_min"))
            s["spec_types"] = ours.spec_types
            if not ours.spec_types:
                raise InputError("nothing to compare: give --spec-type or -md")
            s["ctx_size"] = ctx
        targets.append(ours)
        if s["peer"] == "llama.cpp":
            gguf = getattr(ours, "model_path", None) or s["model"]
            if gguf is None:
                raise InputError("--peer llama.cpp with --url needs -m MODEL.gguf: the GGUF llama.cpp should load")
            targets.append(LlamaCppTarget(gguf, s["threads"] or _threads(), s.get("ctx_size", 2048),
                                          encode=getattr(ours, "encode", None)))
        elif s["peer_url"]:
            targets.append(UrlTarget(s["peer_url"], args.peer_api_key, None, name="peer"))
        configs = [Config(s["spec_types"][0], 0)] + [Config(t, n) for t in s["spec_types"] for n in s["n_max"] if n != 0]
        s["configs"] = [c.label for c in configs]
        for t in targets:  # warm-up, not recorded: first-call costs (kernels, caches, adaptive calibration)
            for c in configs:
                t.request(prompts[0], c.spec_type, c.n_max, 4, s["temp"], s["seed"])
        results = sweep(out, prompts, s["users"], configs, targets, s["repeats"], s["max_tokens"], s["temp"],
                        s["seed"], s, progress=not args.no_progress)
        if args.label:
            results["label"] = args.label
        if s["temp"] == 0:
            by_key = {(p.kind, p.index): p for p in prompts}
            margin = None
            if isinstance(ours, InProcessTarget):
                def margin(target, kind, index, prefix):
                    return ours.top2_margin(by_key[(kind, index)], prefix) if target == ours.name else None
            results["lossless"] = lossless(results, margin)
        results["summary"] = summarize(results)  # the report's figures, computed from the phases above
        write_json(out / "results.json", results)
        write_report(out, results, results["summary"])
    finally:
        for t in targets:
            t.close()
    done = len(results["phases"])
    if results.get("interrupted"):
        print(f"\ninterrupted: {done} finished phase(s) kept in {out}/results.json, report.md and the plots",
              file=sys.stderr)
        return 130
    bad = len(results.get("lossless") or [])
    print(f"wrote {out}/results.json, report.md, speedup.png, users.png, acceptance.png ({done} phases"
          + (f"; {bad} lossless mismatch(es), see report.md" if bad else "") + ")", file=sys.stderr)
    return 0


def _threads() -> int:
    from ..loading.engine import physical_cores

    return physical_cores()
