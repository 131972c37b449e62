"""``report.md`` and the PNG plots, drawn from ``results.json`` alone (``gemmaspec bench --report-only
DIR`` redraws them). The plots are :mod:`.plots`'s.

The report is for people: the header is plain text (machine, what was measured, settings), every
speedup within noise (:func:`.analyze.within_noise`) is marked ``~``, the crossover counts only
speedups outside noise, and a paragraph says why aggregate and per-user speedups differ."""

from __future__ import annotations

import json
import string
from pathlib import Path

from .analyze import ALL, NOISE, chosen_where_it_stops, crossover_sentence, summarize, within_noise
from .plots import BAND, PLOT_DPI, PLOT_SIZE, PLOTS, draw_plots
from .run import plan_summary

__all__ = ["PLOTS", "PLOT_DPI", "PLOT_SIZE", "write_report", "markdown", "header", "load_results"]

LABELS = {"model": "model", "model_sha256": "sha256", "spec_types": "drafters", "drafts": "drafter files",
          "p_min": "p-min", "ctx_size": "context per slot (tokens)", "device": "device", "threads": "threads",
          "batched": "batched forward", "url": "URL", "metrics": "/metrics counters", "models": "served models",
          "props": "server /props", "version": "version", "speculation": "speculation", "input": "input"}
"""Readable names of the keys a target's ``describe()`` gives; any other key is shown by its name."""
KIND_NAMES = {"in-process": "in this process", "url": "a server", "llama-cpp-python": "llama-cpp-python"}


def _f(x, fmt="{:.1f}", none="-"):
    return none if x is None else fmt.format(x)


def _x(x, spread=None, baseline=False):
    """A speedup, ``~`` in front when it is within noise (never for the baseline's own 1.00x)."""
    if x is None:
        return "-"
    return f"{'~' if within_noise(x, spread) and not baseline else ''}{x:.2f}x"


def _sx(c: dict, which: str = "aggregate") -> str:
    """A cell's aggregate or per-user speedup with its noise mark."""
    return _x(c[f"speedup_{which}"], c.get(f"speedup_{which}_range"), c["config"] == "none")


def write_report(out_dir: Path, results: dict, summary: dict | None = None, plots: bool = True) -> dict:
    """Write ``report.md`` (and the plots) into ``out_dir``; returns the summary used."""
    summary = summary or summarize(results)
    (out_dir / "report.md").write_text(markdown(results, summary))
    if plots:
        draw_plots(out_dir, results, summary)
    return summary


def _text(v, depth: int = 0) -> str:
    """A value of ``results.json`` as words: no braces, brackets or quotes; a sha256 shortened."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, str) and len(v) == 64 and all(ch in string.hexdigits for ch in v):
        return v[:16] + "..."
    if isinstance(v, dict):
        inner = ", ".join(f"{k} {_text(x, depth + 1)}" for k, x in v.items() if x not in (None, "", [], {}))
        return f"({inner})" if depth else inner
    if isinstance(v, (list, tuple)):
        return ", ".join(_text(x, depth + 1) for x in v)
    return str(v)


def _target_line(t: dict) -> str:
    kind = t.get("kind")
    lead = f"**{t.get('name', '?')}** ({KIND_NAMES.get(kind, kind)}"
    lead += f" {t['version']})" if kind == "llama-cpp-python" and t.get("version") else ")"
    parts = [f"{LABELS.get(k, k.replace('_', ' '))}: {_text(v)}" for k, v in t.items()
             if k not in ("kind", "name") and not (k == "version" and kind == "llama-cpp-python")
             and v not in (None, "", [], {})]
    return f"- {lead}: " + "; ".join(parts) + "."


def header(results: dict) -> list[str]:
    """The report's opening lines: label, state, machine, versions, each target, settings; plain text."""
    st, m = results.get("settings", {}), results.get("machine", {})
    lines = ["# gemmaspec bench", ""]
    if results.get("label"):
        lines += [f"> {results['label']}", ""]
    if results.get("interrupted"):
        lines += ["**Interrupted**: only the phases that finished are included below.", ""]
    if results.get("error"):
        lines += [f"**Stopped by an error**: {results['error']}", ""]
    machine = [f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores"] + ([f"GPU {m['gpu']}"] if m.get("gpu") else [])
    machine += ([f"Python {m['python']}"] if m.get("python") else []) + ([m["platform"]] if m.get("platform") else [])
    load = (m.get("loadavg_start") or [None])[0]
    lines.append(f"**Machine**: {', '.join(machine)}; 1-minute load average at the start {_f(load, '{:.2f}')}. "
                 f"Started {str(results.get('started', '?')).replace('T', ' ')}"
                 + (f", finished {str(results['finished']).replace('T', ' ')}" if results.get("finished") else "")
                 + ".")
    vers = [f"{k} {v}" for k, v in (results.get("versions") or {}).items() if v]
    if vers:
        lines += ["", f"**Versions**: {', '.join(vers)}."]
    if results.get("targets"):
        lines += ["", "**Measured**:", ""] + [_target_line(t) for t in results["targets"]]
    lines += ["", "**Settings**: " + "; ".join(_settings(st)) + ".", ""]
    if st.get("configs"):
        lines += [f"**Configurations**: {', '.join(st['configs'])}.", ""]
    return lines


def _plural(n, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _settings(st: dict) -> list[str]:
    """The settings as phrases; a setting the results lack is left out."""
    out = [f"suite {st['suite']}"] if st.get("suite") else []
    kinds = st.get("kinds") or []
    if kinds:
        out.append(f"{_plural(len(kinds), 'kind')} ({', '.join(kinds)})")
    ppk = st.get("prompts_per_kind")
    out.append((f"{_plural(ppk, 'prompt')} per kind (the first)" if ppk else "every prompt of each kind")
               + (f", {st['prompts']} in all" if st.get("prompts") else ""))
    if st.get("max_tokens"):
        out.append(f"{st['max_tokens']} tokens per request (end of sequence ignored)")
    if st.get("temp") is not None:
        out.append("greedy (temperature 0)" if st["temp"] == 0 else f"temperature {st['temp']:g}")
    if st.get("users"):
        out.append(f"users {', '.join(str(u) for u in st['users'])}")
    if st.get("repeats"):
        out.append(_plural(st["repeats"], "repeat"))
    n_max = [str(n) for n in st.get("n_max") or [] if n != 0]
    if n_max:
        out.append(f"draft lengths {', '.join(n_max)} and none (the baseline)")
    if st.get("quick"):
        out.append("the --quick preset")
    return out


def _noise_text(results: dict) -> list[str]:
    reps = (results.get("settings") or {}).get("repeats")
    lines = ["**Noise.** A speedup is the median over repeats of a configuration's tokens/s over the median of "
             "the no-speculation run's; its spread is the range (min to max) of the per-repeat ratios, each "
             "repeat's run against the same repeat's no-speculation run (the configurations take turns). A speedup "
             f"is *within noise*, marked `~`, when it is within ±{NOISE:.0%} of 1.00x or its spread includes 1.00x; "
             "only a speedup outside noise counts as paying. The plots draw the spreads as error bars and bands "
             f"({BAND})."]
    if reps == 1:
        lines[0] += (" This run has one repeat, so there is no spread and only the ±3% band applies: run "
                     "`--repeats 3` before trusting a small difference.")
    return lines + [""]


def _aggregate_vs_user(s: dict, targets: list[str]) -> list[str]:
    lines = ["**Aggregate and per-user speedups differ.** Aggregate tokens/s is all completion tokens of a "
             "phase over its wall time: the machine's throughput, including every request's prefill (time to "
             "first token) and, with several users, the waits for a turn. Per-user tokens/s is the median "
             "request's decode speed after its first token: what one user sees while the text streams. "
             "Speculation speeds up decoding only, so its per-user speedup is larger when prefill is a large "
             "share of the time (short requests, long prompts), and a median request of a kind where drafts "
             "often hit counts as much as a slow one, whereas the aggregate weighs every request by its time."]
    for t in targets:
        cs = [c for c in s["cells"] if c["target"] == t and c["kind"] == ALL and c["config"] != "none"
              and c["speedup_aggregate"] is not None]
        if not cs:
            continue
        u0 = min(c["users"] for c in cs)
        b = max((c for c in cs if c["users"] == u0), key=lambda c: c["speedup_aggregate"])
        lines[0] += (f" Here ({t}, all kinds, {u0} user{'s' if u0 != 1 else ''}), the best configuration, "
                     f"{b['config']}, gives {_sx(b)} aggregate and {_sx(b, 'per_user')} per user.")
    return lines + [""]


def markdown(results: dict, s: dict) -> str:
    """The whole ``report.md`` from the results and their summary (:func:`.analyze.summarize`)."""
    cells = s["cells"]
    targets = list(dict.fromkeys(c["target"] for c in cells)) or [t["name"] for t in results.get("targets", [])]
    lines = header(results)
    lines += ["Figures are defined in docs/benchmarks.md. Compare ratios measured in the same run.", ""]
    lines += ["## Crossover", ""]
    for t in targets:
        lines.append(crossover_sentence(s["crossover"].get(t, {}), t))
        chosen = chosen_where_it_stops(cells, s["crossover"].get(t, {}), t)
        if chosen:
            lines += ["", chosen]
    lines += [""] + ([plan_summary(results), ""] if plan_summary(results) else [])
    lines += _noise_text(results) + _aggregate_vs_user(s, targets)
    for t in targets:
        tc = [c for c in cells if c["target"] == t]
        if tc:
            lines += _kind_table(t, tc) + _users_tables(t, tc) + _acceptance_table(t, tc)
    lines += _peer_table(s) + _lossless(results)
    lines += ["", "Plots: " + ", ".join(f"![{p}]({p})" for p in PLOTS), ""]
    return "\n".join(lines)


def _kind_table(t: str, tc: list[dict]) -> list[str]:
    u0 = min(c["users"] for c in tc)
    configs = list(dict.fromkeys(c["config"] for c in tc))
    kinds = list(dict.fromkeys(c["kind"] for c in tc))
    autos = [cfg for cfg in configs if cfg.endswith(" n=auto")]
    lines = [f"## {t}: speedup by kind and draft length ({u0} user{'s' if u0 > 1 else ''})", "",
             "Aggregate output tokens/s (speedup against `none`, `~` within noise)"
             + ("; auto / best fixed: auto's tokens/s over the best fixed draft length's of the same drafter"
                if autos else "") + ".", "",
             "| kind | " + " | ".join(configs + [f"{a} / best fixed" for a in autos]) + " |",
             "|---|" + "---:|" * (len(configs) + len(autos))]
    for k in kinds:
        row = []
        for cfg in configs:
            c = _find(tc, cfg, k, u0)
            row.append("" if c is None else (_f(c["aggregate_tps"]) if cfg == "none" else
                                             f"{_f(c['aggregate_tps'])} ({_sx(c)})"))
        for a in autos:
            ca = _find(tc, a, k, u0)
            fixed = [c["aggregate_tps"] for cfg in configs if cfg.startswith(a[:-len("auto")]) and cfg != a
                     for c in [_find(tc, cfg, k, u0)] if c and c["aggregate_tps"]]
            row.append(_f(ca["aggregate_tps"] / max(fixed), "{:.3f}") if ca and ca["aggregate_tps"] and fixed else "-")
        lines.append(f"| {k} | " + " | ".join(row) + " |")
    return lines


def _sp(c: dict, key: str, fmt: str) -> str:
    return _f((c["spec"] or {}).get(key), fmt)


USERS_COLUMNS = [
    ("users", True, lambda c: str(c["users"])),
    ("config", False, lambda c: c["config"]),
    ("aggregate tok/s", True, lambda c: _f(c["aggregate_tps"])),
    ("per-user tok/s", True, lambda c: _f(c["per_user_tps"])),
    ("speedup (agg / per user)", True, lambda c: f"{_sx(c)} / {_sx(c, 'per_user')}"),
    ("TTFT p50 / p95 ms", True, lambda c: f"{_f(c['ttft_p50_ms'], '{:.0f}')} / {_f(c['ttft_p95_ms'], '{:.0f}')}"),
    ("ITL p50 / p95 ms", True, lambda c: f"{_f(c['itl_p50_ms'])} / {_f(c['itl_p95_ms'])}"),
    ("acceptance", True, lambda c: _sp(c, "acceptance_rate", "{:.3f}")),
    ("mean len", True, lambda c: _sp(c, "mean_accepted_length", "{:.2f}")),
    ("peak RSS MiB", True, lambda c: _f(c.get("peak_rss_mib"), "{:.0f}")),
]
"""The by-users table (all kinds): (header, right-aligned, cell -> text). A new figure of a cell is one
more row here."""
KIND_USERS_COLUMNS = [
    ("kind", False, lambda c: c["kind"]),
    ("users", True, lambda c: str(c["users"])),
    ("config", False, lambda c: c["config"]),
    ("aggregate tok/s", True, lambda c: _f(c["aggregate_tps"])),
    ("per-user tok/s", True, lambda c: _f(c["per_user_tps"])),
    ("speedup", True, _sx),
    ("TTFT p50 ms", True, lambda c: _f(c["ttft_p50_ms"], "{:.0f}")),
    ("ITL p50 ms", True, lambda c: _f(c["itl_p50_ms"])),
    ("acceptance", True, lambda c: _sp(c, "acceptance_rate", "{:.3f}")),
    ("mean len", True, lambda c: _sp(c, "mean_accepted_length", "{:.2f}")),
]
"""The per kind and users table, as :data:`USERS_COLUMNS`."""


def table(columns: list, cells: list[dict]) -> list[str]:
    """A markdown table: one row per cell, one column per ``(header, right-aligned, cell -> text)``."""
    return (["| " + " | ".join(h for h, _, _ in columns) + " |",
             "|" + "".join("---:|" if right else "---|" for _, right, _ in columns)]
            + ["| " + " | ".join(fn(c) for _, _, fn in columns) + " |" for c in cells])


def _users_tables(t: str, tc: list[dict]) -> list[str]:
    return (["", f"## {t}: by number of users (all kinds)", ""]
            + table(USERS_COLUMNS, [c for c in tc if c["kind"] == ALL])
            + ["", f"## {t}: per kind and number of users", ""]
            + table(KIND_USERS_COLUMNS, [c for c in tc if c["kind"] != ALL]))


def _acceptance_table(t: str, tc: list[dict]) -> list[str]:
    lines = []
    u0 = min(c["users"] for c in tc)
    pos = [c for c in tc if c["kind"] == ALL and c["users"] == u0 and (c["spec"] or {}).get("acceptance_per_pos")]
    if pos:
        n = max(len(c["spec"]["acceptance_per_pos"]) for c in pos)
        lines += ["", f"## {t}: acceptance per draft position ({u0} user{'s' if u0 > 1 else ''}, all kinds)", "",
                  "| config | " + " | ".join(f"pos {i + 1}" for i in range(n)) + " |", "|---|" + "---:|" * n]
        for c in pos:
            pp = c["spec"]["acceptance_per_pos"]
            lines.append(f"| {c['config']} | " + " | ".join(_f(pp[i] if i < len(pp) else None, "{:.3f}")
                                                          for i in range(n)) + " |")
    if [c for c in tc if c["config"] != "none" and c["kind"] == ALL and c["spec"] is None]:
        lines += ["", f"{t} reported no acceptance (no `timings` with draft_n in its responses and no speculative "
                      "counters in `/metrics`): acceptance columns are empty."]
    return lines + [""]


def _peer_table(s: dict) -> list[str]:
    if not s["peer"]:
        return []
    lines = ["## Side by side (ours / peer, same configuration, kind and users)", "",
             "| peer | kind | users | config | aggregate ratio | per-user ratio |", "|---|---|---:|---|---:|---:|"]
    for p in sorted(s["peer"], key=lambda p: (p["peer"], p["kind"] != ALL, p["kind"], p["users"], p["config"])):
        lines.append(f"| {p['peer']} | {p['kind']} | {p['users']} | {p['config']} | "
                     f"{_f(p['aggregate_ratio'], '{:.2f}x')} | {_f(p['per_user_ratio'], '{:.2f}x')} |")
    return lines + [""]


def _lossless(results: dict) -> list[str]:
    lines = ["## Lossless check", ""]
    ll = results.get("lossless")
    if ll is None:
        lines.append("Not run (temperature > 0: sampled outputs may differ legitimately).")
    elif not ll:
        lines.append("Every output at temperature 0 equals the no-speculation output of the same prompt.")
    else:
        lines += [f"{len(ll)} mismatch(es) against the no-speculation output (a small top-2 margin is a near-tie, "
                  "where summation order can flip the argmax; a wide one is a bug):", "",
                  "| target | config | users | kind | prompt | first difference | got / expected | top-2 margin | seen |",
                  "|---|---|---:|---|---:|---:|---|---:|---:|"]
        for x in ll:
            lines.append(f"| {x['target']} | {x['config']} | {x['users']} | {x['kind']} | {x['index']} | "
                         f"{x['unit']} {x['position']} | {x['got']!r} / {x['expected']!r} | "
                         f"{_f(x.get('top2_margin'), '{:.4f}')} | {x['count']} |")
    return lines


def _find(cells, cfg, kind, users):
    return next((c for c in cells if c["config"] == cfg and c["kind"] == kind and c["users"] == users), None)


def load_results(out_dir: Path) -> dict:
    """``out_dir/results.json`` as a dict."""
    return json.loads((Path(out_dir) / "results.json").read_text())
