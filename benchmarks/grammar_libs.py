"""Which constrained-decoding library for `gemmaspec serve`? llguidance, xgrammar and outlines-core
measured on the default model's tokenizer (Gemma 3, 262,144 tokens).

For each library and grammar: the one-time tokenizer setup, the time to compile the grammar (fresh,
no cache; median of 3), and the per-token mask cost: the time to compute the allowed-token bitmask
at each position while feeding a valid document token by token (median and 90th percentile over
every position of 5 passes). Grammars: any JSON object (`response_format: json_object`), a JSON
schema with a string, an integer, an enum and an array, and a GBNF grammar (llama-server's
`grammar`; outlines-core has no grammar support, only regular expressions, so it gets no GBNF row).

    python benchmarks/grammar_libs.py [LIBRARY...]   # writes benchmarks/results/grammar_libs.{json,md}

Run it niced on an idle machine; the numbers are medians, not minima.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from gemmaspec.manage.default_model import default_model_path  # noqa: E402
from gemmaspec.loading.gguf_header import read_header  # noqa: E402
from gemmaspec.loading.tokenizer_cache import gguf_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "role", "tags"], "additionalProperties": False}
DOC = '{"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "poetry", "analytical engines"]}'
GBNF = r'''root ::= "Items: " item ("," ws item)* "."
item ::= [a-z]+ (" " [a-z]+)? | [0-9]+
ws ::= " "?'''
GBNF_DOC = "Items: apples, pears and, 42, figs."
GRAMMARS = {"json_object": ('{"type": "object"}', DOC), "json_schema": (json.dumps(SCHEMA), DOC),
            "gbnf": (GBNF, GBNF_DOC.replace(" and", " and"))}


def median(xs):
    return statistics.median(xs)


def p90(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


def vocab_bytes(tok) -> list[bytes]:
    """Each token id's bytes as the model writes it (▁ = space, <0xNN> = that byte); control tokens b""."""
    out = []
    special = tok.special_ids
    for i in range(tok.vocab_size):
        s = tok.backend.id_to_token(i) or ""
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", s)
        if i in special:
            out.append(b"")
        elif m:
            out.append(bytes([int(m.group(1), 16)]))
        else:
            out.append(s.replace("\u2581", " ").encode())
    return out


def run_doc(mask_fn, consume_fn, reset_fn, ids, passes=5):
    times = []
    for _ in range(passes):
        reset_fn()
        for t in ids:
            t0 = time.perf_counter()
            mask_fn()
            times.append((time.perf_counter() - t0) * 1e3)
            if not consume_fn(t):
                raise RuntimeError(f"token {t} refused")
    return times


def bench_llguidance(tok, ids_of):
    import llguidance
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=sorted(tok.stop_ids))
    setup = time.perf_counter() - t0
    rows = {}
    for name, (src, doc) in GRAMMARS.items():
        grammar = llguidance.grammar_from("gbnf" if name == "gbnf" else "json_schema", src)
        comp = []
        for _ in range(3):
            t0 = time.perf_counter()
            m = llguidance.LLMatcher(lltok, grammar)
            assert not m.is_error(), m.get_error()
            comp.append((time.perf_counter() - t0) * 1e3)
        mask = lt.allocate_token_bitmask(1, tok.vocab_size)
        times = run_doc(lambda: lt.fill_next_token_bitmask(m, mask), m.consume_token, m.reset, ids_of(doc))
        rows[name] = {"compile_ms": median(comp), "mask_ms": median(times), "mask_p90_ms": p90(times)}
    return {"version": llguidance.__version__ if hasattr(llguidance, "__version__") else "", "setup_s": setup,
            "rows": rows}


def bench_xgrammar(tok, ids_of):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo([tok.backend.id_to_token(i) or "" for i in range(tok.vocab_size)],
                             xgr.VocabType.BYTE_FALLBACK, vocab_size=tok.vocab_size,
                             stop_token_ids=sorted(tok.stop_ids), add_prefix_space=False)
    setup = time.perf_counter() - t0
    rows = {}
    for name, (src, doc) in GRAMMARS.items():
        comp = []
        for _ in range(3):
            compiler = xgr.GrammarCompiler(info, cache_enabled=False, max_threads=1)
            t0 = time.perf_counter()
            if name == "gbnf":
                cg = compiler.compile_grammar(src)
            elif name == "json_object":
                cg = compiler.compile_builtin_json_grammar()
            else:
                cg = compiler.compile_json_schema(src, any_whitespace=True)
            comp.append((time.perf_counter() - t0) * 1e3)
        m = xgr.GrammarMatcher(cg)
        mask = xgr.allocate_token_bitmask(1, tok.vocab_size)
        times = run_doc(lambda: m.fill_next_token_bitmask(mask), m.accept_token, m.reset, ids_of(doc))
        rows[name] = {"compile_ms": median(comp), "mask_ms": median(times), "mask_p90_ms": p90(times)}
    from importlib.metadata import version

    return {"version": version("xgrammar"), "setup_s": setup, "rows": rows}


def bench_outlines(tok, ids_of):
    import outlines_core as oc
    from importlib.metadata import version

    t0 = time.perf_counter()
    by = {}
    for i, b in enumerate(vocab_bytes(tok)):
        if b and i not in tok.stop_ids:
            by.setdefault(b, []).append(i)
    vocab = oc.Vocabulary(tok.eos_id, by)
    setup = time.perf_counter() - t0
    rows = {}
    for name, (src, doc) in GRAMMARS.items():
        if name == "gbnf":
            continue  # regular expressions only
        regex = oc.json_schema.build_regex_from_schema(src, whitespace_pattern=r"[ ]?")
        comp = []
        for _ in range(3):
            t0 = time.perf_counter()
            index = oc.Index(regex, vocab)
            comp.append((time.perf_counter() - t0) * 1e3)
        g = oc.Guide(index)
        mask = torch.full((1, (tok.vocab_size + 31) // 32), -1, dtype=torch.int32)

        def consume(t):
            g.advance(t, return_tokens=False)
            return True

        times = run_doc(lambda: g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size()),
                        consume, g.reset, ids_of(doc))
        rows[name] = {"compile_ms": median(comp), "mask_ms": median(times), "mask_p90_ms": p90(times)}
    return {"version": version("outlines-core"), "setup_s": setup, "rows": rows}


def bench_gemmaspec(tok, ids_of):
    """What a token costs in gemmaspec's sampler: Constraint.mask() (llguidance's bitmask, unpacked to
    bool [V]) and the masked greedy / sampled draw, against the unmasked draw."""
    from gemmaspec.grammar import json_schema_grammar
    from gemmaspec.sampling import SamplingParams, filtered_probs

    c = json_schema_grammar(SCHEMA).constraint(tok)
    logits = torch.randn(tok.vocab_size)
    out = {}
    masks = run_doc(c.mask, lambda t: (c.consume(t), True)[1], lambda: c.rollback(c.consumed), ids_of(DOC))
    out["Constraint.mask()"] = median(masks)
    m = c.mask()
    for name, params in (("greedy", SamplingParams(temperature=0)), ("sampled", SamplingParams(temperature=0.8))):
        for masked in (False, True):
            ts = []
            for _ in range(50):
                t0 = time.perf_counter()
                filtered_probs(logits, params, (), m if masked else None)
                ts.append((time.perf_counter() - t0) * 1e3)
            out[f"filtered_probs {name}{' masked' if masked else ''}"] = median(ts)
    return out


def main() -> None:
    torch.set_num_threads(1)
    tok = gguf_tokenizer(read_header(default_model_path()))

    def ids_of(text):
        return tok.encode(text, add_bos=False)

    import platform

    res = ROOT / "benchmarks" / "results"
    only = sys.argv[1:]  # library names to (re)measure; the others are kept from the last run
    old = json.loads((res / "grammar_libs.json").read_text()) if only and (res / "grammar_libs.json").exists() else {}
    out = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "vocab": tok.vocab_size,
           "libraries": old.get("libraries", {})}
    if not only or "gemmaspec" in only:
        out["gemmaspec_ms"] = bench_gemmaspec(tok, ids_of)
        print(out["gemmaspec_ms"])
    elif "gemmaspec_ms" in old:
        out["gemmaspec_ms"] = old["gemmaspec_ms"]
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar),
                     ("outlines-core", bench_outlines)):
        if only and name not in only:
            continue
        try:
            out["libraries"][name] = fn(tok, ids_of)
        except Exception as exc:  # noqa: BLE001 - a library that fails is reported, not fatal
            out["libraries"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(name, json.dumps(out["libraries"][name], indent=1), flush=True)
    res.mkdir(exist_ok=True)
    (res / "grammar_libs.json").write_text(json.dumps(out, indent=1))
    lines = ["| library | tokenizer setup (s) | grammar | compile (ms) | mask per token, median (ms) | p90 (ms) |",
             "|---|---|---|---|---|---|"]
    for lib, r in out["libraries"].items():
        if "error" in r:
            lines.append(f"| {lib} | | | {r['error']} | | |")
            continue
        for g, row in r["rows"].items():
            lines.append(f"| {lib} {r['version']} | {r['setup_s']:.2f} | {g} | {row['compile_ms']:.1f} | "
                         f"{row['mask_ms']:.3f} | {row['mask_p90_ms']:.3f} |")
    if "gemmaspec_ms" in out:
        lines += ["", "| in gemmaspec's sampler (json_schema) | ms, median |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in out["gemmaspec_ms"].items()]
    (res / "grammar_libs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
