"""``gemmaspec train-drafter`` and ``gemmaspec eval-drafter``."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from ..errors import InputError


def add_parsers(sub) -> None:
    t = sub.add_parser("train-drafter", allow_abbrev=False,
                       help="distil an MTP assistant (gemma4-assistant GGUF) from a target, on this machine")
    t.add_argument("-m", "--model", default=None, help="target GGUF or checkpoint directory (default: the default model)")
    t.add_argument("--data", nargs="+", default=["builtin"],
                   help="text files to train on (UTF-8; .jsonl: the 'text' field of each line), or 'builtin': Python's "
                        "own documentation and standard library (default); the target's own continuations of "
                        "gemmaspec's prompts are added unless --no-self")
    t.add_argument("--no-self", action="store_true", help="do not add the target's own generated text")
    t.add_argument("--self-prompts", type=int, default=0,
                   help="also continue this many generated requests (templates x topics, stdlib and pydoc pieces; "
                        "half as chat turns) with the target, recording its teacher signals while it generates")
    t.add_argument("--self-temperature", type=float, default=0.8, help="temperature of the sampled self-generations")
    t.add_argument("--self-sample-frac", type=float, default=0.33,
                   help="fraction of --self-prompts continued by sampling (the rest greedy)")
    t.add_argument("--init", default=None,
                   help="start a new run from another run's checkpoint (ckpt.pt) or from an assistant GGUF train-drafter "
                        "wrote (e.g. the shipped one): its weights and architecture; the draft vocabulary is chosen "
                        "from this run's data (shared tokens keep their head rows); fresh optimiser and schedule")
    t.add_argument("--out", required=True, help="the assistant GGUF to write")
    t.add_argument("--work-dir", default=None, help="checkpoints and history (default: OUT without .gguf + '.run')")
    t.add_argument("--width", type=int, default=256)
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--ffn", type=int, default=1024)
    t.add_argument("--draft-vocab", type=int, default=8192, help="rows of the reduced head (target's most frequent tokens)")
    t.add_argument("--steps", type=int, default=2000, help="optimiser steps (one text chunk each)")
    t.add_argument("--draft-steps", type=int, default=3, help="draft steps unrolled per position (K)")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=100, help="linear warm-up steps before the cosine decay")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--qat", choices=["q4_0"], default=None, help="train on the Q4_0 grid (exports exact Q4_0)")
    t.add_argument("--outtype", choices=["q4_0", "q8_0", "f16", "f32"], default=None,
                   help="matrix type of the export (default: q4_0 with --qat q4_0, else q8_0)")
    t.add_argument("--resume", action="store_true", help="continue the run in --work-dir from its checkpoint")
    t.add_argument("--ckpt-every", type=int, default=100)
    t.add_argument("--eval-every", type=int, default=100, help="held-out acceptance estimate every this many steps")
    t.add_argument("--max-minutes", type=float, default=None,
                   help="stop after this much training time with a checkpoint and an export of the state so far "
                        "(--resume continues)")
    t.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    t.add_argument("-t", "--threads", type=int, default=None)
    e = sub.add_parser("eval-drafter", allow_abbrev=False,
                       help="acceptance and speed of an MTP assistant on held-out prompts, against plain decoding")
    e.add_argument("-m", "--model", default=None)
    e.add_argument("-md", "--model-draft", required=True)
    e.add_argument("--prompts", default=None, help="a file of prompts, one per line (\\n escapes allowed); default: "
                   "the speculative benchmark's held-out prompts")
    e.add_argument("-n", "--n-predict", type=int, default=128)
    e.add_argument("--spec-draft-n-max", default="3")
    e.add_argument("--spec-draft-p-min", type=float, default=None,
                   help="stop a round's drafting below this draft probability (default 0; the measured value for "
                        "an assistant gemmaspec ships)")
    e.add_argument("-t", "--threads", type=int, default=None)


def _read_data(files: list[str]) -> list[str]:
    texts = []
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise InputError(f"--data {f}: no such file")
        raw = p.read_text(encoding="utf-8", errors="replace")
        if p.suffix == ".jsonl":
            for i, line in enumerate(raw.splitlines(), 1):
                if line.strip():
                    try:
                        texts.append(json.loads(line)["text"])
                    except (ValueError, KeyError, TypeError):
                        raise InputError(f"{f} line {i}: expected a JSON object with a 'text' field") from None
        else:
            texts += [raw[i:i + 4000] for i in range(0, len(raw), 4000)]
    return texts


def run_train(args) -> int:
    import torch

    from ..loading.engine import set_threads
    from ..loading import load_checkpoint
    from ..manage.default_model import default_model_path
    from ..paths import cache_home
    from ..training.corpus import SELF_PROMPTS, build_corpus, held_out_texts, self_generated
    from ..loading.assistant_gguf import export_gguf
    from ..training.teacher import build_chunks, chunk_dir
    from ..training.train import TrainSettings, train

    if args.device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: this PyTorch sees no CUDA GPU; use --device cpu")
    set_threads(args.threads)
    t0 = time.perf_counter()
    target_path = Path(args.model) if args.model else default_model_path()
    loaded = load_checkpoint(target_path, "cpu", role="target")
    model, tok = loaded.model, loaded.tokenizer
    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else out.with_name(out.stem + ".run")
    work.mkdir(parents=True, exist_ok=True)
    corpus_file = work / "corpus.json"
    if corpus_file.exists():
        corpus = json.loads(corpus_file.read_text())
        seqs, info = corpus["seqs"], corpus["info"]
        print(f"corpus: {info['tokens']} tokens (from {corpus_file})", file=sys.stderr)
    else:
        print("building the corpus (the target writes its own continuations first)...", file=sys.stderr, flush=True)
        if args.data == ["builtin"]:
            seqs, info = build_corpus(model, tok, self_tokens=0 if args.no_self else 256)
        else:
            texts = _read_data(args.data)
            held = held_out_texts()
            for text in texts:
                for h in held:
                    if h.strip() in text:
                        raise InputError(f"--data contains a held-out benchmark prompt ({h[:50]!r}); remove it")
            seqs = [tok.encode(t) for t in texts]
            info = {"files": args.data, "pieces": len(seqs), "tokens": sum(map(len, seqs))}
            if not args.no_self:
                gen = self_generated(model, tok, SELF_PROMPTS, 256)
                seqs += gen
                info["self"] = {"pieces": len(gen), "tokens": sum(map(len, gen))}
            info["key"] = hashlib.sha256(json.dumps(seqs).encode()).hexdigest()[:16]
            info["tokens"] = sum(map(len, seqs))
        corpus_file.write_text(json.dumps({"seqs": seqs, "info": info}))
        print(f"corpus: {info['tokens']} tokens", file=sys.stderr)
    cdir = chunk_dir(cache_home() / "drafter-data", target_path, info["key"])
    from tqdm import tqdm

    bar = tqdm(desc="teacher signals", unit="chunk")

    def prog(i, n):
        bar.total = n
        bar.n = i
        bar.refresh()

    paths = build_chunks(model, seqs, cdir, progress=prog)
    bar.close()
    held_paths = None
    if args.self_prompts:
        import hashlib as _h

        from ..training.selfgen import generate_chunks, generated_prompts, selfgen_dir

        gdir = selfgen_dir(cdir.parent, args.seed, 256, args.self_sample_frac, args.self_temperature)
        bar = tqdm(desc="self-generation (with teacher signals)", unit="prompt")
        held = held_out_texts()
        gen = generate_chunks(model, tok, generated_prompts(args.self_prompts, args.seed, held), gdir,
                              sample_frac=args.self_sample_frac, temperature=args.self_temperature, seed=args.seed,
                              batch=8, held=held, progress=prog)
        bar.close()
        print(f"self-generated: {len(gen)} chunks in {gdir}", file=sys.stderr)
        # held out: the corpus's own held-out tail (as a run without --self-prompts, so a run started with
        # --init from one never saw it) and the last 5% of the generated chunks; training order: the rest,
        # in an order fixed by the file names
        hc, hg = max(1, int(len(paths) * 0.05)), max(1, int(len(gen) * 0.05))
        held_paths = paths[len(paths) - hc:] + gen[len(gen) - hg:]
        paths = sorted(paths[:len(paths) - hc] + gen[:len(gen) - hg],
                       key=lambda q: _h.sha256(q.name.encode()).hexdigest())
    settings = TrainSettings(width=args.width, layers=args.layers, heads=args.heads, ffn=args.ffn,
                             draft_vocab=args.draft_vocab, steps=args.steps, draft_steps=args.draft_steps, lr=args.lr,
                             seed=args.seed, qat=args.qat, ckpt_every=args.ckpt_every,
                             eval_every=args.eval_every, warmup=args.warmup)
    try:
        if args.init and not Path(args.init).is_file():
            raise InputError(f"--init {args.init}: no such checkpoint or GGUF")
        assistant, history = train(model, paths, work, settings, resume=args.resume,
                                   max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
                                   init=Path(args.init) if args.init else None, held_paths=held_paths)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:
        if args.init and str(args.init) in str(e):
            raise InputError(str(e)) from None
        raise
    outtype = args.outtype or ("q4_0" if settings.qat == "q4_0" else "q8_0")
    res = export_gguf(assistant.config, assistant.gguf_weights(), out, outtype,
                      name=f"gemmaspec assistant for {target_path.name}")
    last = next((h["held_out"] for h in reversed(history) if "held_out" in h), None)
    summary = {"out": str(out), "bytes": res["bytes"], "types": res["types"], "steps": len(history),
               "wall_s": round(time.perf_counter() - t0, 1), "corpus": info, "held_out": last,
               "settings": vars(settings) if hasattr(settings, "__dict__") else {}}
    (work / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"wrote {out} ({res['bytes'] / 1e6:.1f} MB, {res['types']}); held-out teacher-forced acceptance: {last}; "
          f"{summary['wall_s']} s", file=sys.stderr)
    return 0


def run_eval(args) -> int:
    from ..engine import RequestStats
    from ..loading.engine import load_engine
    from ..sampling import SamplingParams
    from ..speculative.config import SpecConfig
    from ..speculative.plan import build, plan

    engine = load_engine(args.model, threads=args.threads)
    spec = SpecConfig("draft-mtp", args.model_draft, args.spec_draft_n_max, p_min=args.spec_draft_p_min)
    make = build(plan(spec, engine.model_path), engine, warn=lambda line: print(line, file=sys.stderr))
    if args.prompts:
        prompts = [line.replace("\\n", "\n") for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    else:
        prompts = _benchmark_prompts()
    n_max = args.spec_draft_n_max if args.spec_draft_n_max == "auto" else int(args.spec_draft_n_max)
    rows = []
    for prompt in prompts:
        ids = engine.tokenizer.encode(prompt)
        params = SamplingParams(temperature=0.0, max_tokens=args.n_predict, ignore_eos=True)
        plain_st, spec_st = RequestStats(), RequestStats()
        plain = [t for ev in engine.generate(ids, params, stats=plain_st) for t in ev.tokens]
        spec = [t for ev in engine.generate(ids, params, make(engine.cache), n_max=n_max, stats=spec_st) for t in ev.tokens]
        d = spec_st.spec.to_dict()
        rows.append({"prompt": prompt[:40], "same_output": plain == spec, "plain_tps": plain_st.decode_tps,
                     "mtp_tps": spec_st.decode_tps, **d})
        print(json.dumps(rows[-1]), flush=True)
    drafted = sum(r["draft_n"] for r in rows)
    accepted = sum(r["draft_n_accepted"] for r in rows)
    steps = sum(r["verify_steps"] for r in rows)
    print(f"acceptance {accepted / max(1, drafted):.3f}, mean accepted length {1 + accepted / max(1, steps):.2f}, "
          f"outputs equal to plain: {sum(r['same_output'] for r in rows)}/{len(rows)}", file=sys.stderr)
    return 0


def _benchmark_prompts() -> list[str]:
    root = Path(__file__).resolve().parents[3] / "benchmarks" / "speculative.py"
    if not root.exists():
        raise InputError("no --prompts file and no benchmarks/speculative.py beside this installation")
    import ast

    for node in ast.walk(ast.parse(root.read_text())):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PROMPTS":
            env: dict = {}
            src = root.read_text()
            exec(compile(ast.Module([n for n in ast.parse(src).body if isinstance(n, ast.Assign)
                                     and getattr(n.targets[0], "id", None) in ("PARAGRAPH", "PROMPTS")], []),
                         str(root), "exec"), env)
            return [p for ps in env["PROMPTS"].values() for p in ps]
    raise InputError("benchmarks/speculative.py has no PROMPTS")


__all__ = ["add_parsers", "run_train", "run_eval", "argparse"]
