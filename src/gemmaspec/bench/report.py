"""``report.md`` and the PNG plots, drawn from ``results.json`` alone (``gemmaspec bench --report-only
DIR`` redraws them). Plots use matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import json
from pathlib import Path

from .analyze import ALL, crossover_sentence, summarize
from .run import plan_summary

PLOT_SIZE = (8.0, 4.5)  # inches
PLOT_DPI = 100  # so every PNG is 800 x 450 pixels
PLOTS = ("speedup.png", "users.png", "acceptance.png")


def _f(x, fmt="{:.1f}", none="-"):
    return none if x is None else fmt.format(x)


def _x(x):
    return _f(x, "{:.2f}x")


def write_report(out_dir: Path, results: dict, summary: dict | None = None, plots: bool = True) -> dict:
    """Write ``report.md`` (and the plots) into ``out_dir``; returns the summary used."""
    summary = summary or summarize(results)
    (out_dir / "report.md").write_text(markdown(results, summary))
    if plots:
        draw_plots(out_dir, results, summary)
    return summary


def markdown(results: dict, s: dict) -> str:
    st, m = results.get("settings", {}), results.get("machine", {})
    cells = s["cells"]
    targets = list(dict.fromkeys(c["target"] for c in cells)) or [t["name"] for t in results.get("targets", [])]
    lines = ["# gemmaspec bench", ""]
    if results.get("label"):
        lines += [f"> {results['label']}", ""]
    if results.get("interrupted"):
        lines += ["**Interrupted**: only the phases that finished are included below.", ""]
    if results.get("error"):
        lines += [f"**Stopped by an error**: {results['error']}", ""]
    lines.append(f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores"
                 + (f", GPU {m['gpu']}" if m.get("gpu") else "") + f"; started {results.get('started', '?')}; "
                 f"1-minute load average at start {_f((m.get('loadavg_start') or [None])[0], '{:.2f}')}.")
    for t in results.get("targets", []):
        desc = ", ".join(f"{k} {v}" for k, v in t.items() if k not in ("props",) and v not in (None, [], ""))
        lines.append(f"- {desc}")
    lines.append(f"Settings: suite {st.get('suite')}, kinds {', '.join(st.get('kinds') or [])}; "
                 f"{st.get('max_tokens')} tokens per request (EOS ignored), temperature {st.get('temp')}, "
                 f"users {st.get('users')}, {st.get('repeats')} repeat(s); configurations "
                 f"{', '.join(st.get('configs') or [])}.")
    lines += ["", "Figures are defined in docs/benchmarks.md. Timings on a shared or busy machine are noisy; "
              "compare ratios measured in the same run.", ""]
    lines.append("## Crossover")
    lines.append("")
    for t in targets:
        lines.append(crossover_sentence(s["crossover"].get(t, {}), t))
    lines.append("")
    if plan_summary(results):
        lines += [plan_summary(results), ""]
    for t in targets:
        tc = [c for c in cells if c["target"] == t]
        if not tc:
            continue
        u0 = min(c["users"] for c in tc)
        configs = list(dict.fromkeys(c["config"] for c in tc))
        kinds = list(dict.fromkeys(c["kind"] for c in tc))
        autos = [cfg for cfg in configs if cfg.endswith(" n=auto")]
        lines += [f"## {t}: speedup by kind and draft length ({u0} user{'s' if u0 > 1 else ''})", "",
                  "Aggregate output tokens/s (speedup against `none`)"
                  + ("; auto / best fixed: auto's tokens/s over the best fixed draft length's of the same drafter"
                     if autos else "") + ".", "",
                  "| kind | " + " | ".join(configs + [f"{a} / best fixed" for a in autos]) + " |",
                  "|---|" + "---:|" * (len(configs) + len(autos))]
        for k in kinds:
            row = []
            for cfg in configs:
                c = _find(tc, cfg, k, u0)
                row.append("" if c is None else (_f(c["aggregate_tps"]) if cfg == "none" else
                                                 f"{_f(c['aggregate_tps'])} ({_x(c['speedup_aggregate'])})"))
            for a in autos:
                ca = _find(tc, a, k, u0)
                fixed = [c["aggregate_tps"] for cfg in configs if cfg.startswith(a[:-len("auto")]) and cfg != a
                         for c in [_find(tc, cfg, k, u0)] if c and c["aggregate_tps"]]
                row.append(_f(ca["aggregate_tps"] / max(fixed), "{:.3f}") if ca and ca["aggregate_tps"] and fixed
                           else "-")
            lines.append(f"| {k} | " + " | ".join(row) + " |")
        lines += ["", f"## {t}: by number of users (all kinds)", "",
                  "| users | config | aggregate tok/s | per-user tok/s | speedup (agg / per user) | TTFT p50 / p95 ms "
                  "| ITL p50 / p95 ms | acceptance | mean len | peak RSS MiB |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c in tc:
            if c["kind"] != ALL:
                continue
            sp = c["spec"] or {}
            lines.append(f"| {c['users']} | {c['config']} | {_f(c['aggregate_tps'])} | {_f(c['per_user_tps'])} | "
                         f"{_x(c['speedup_aggregate'])} / {_x(c['speedup_per_user'])} | "
                         f"{_f(c['ttft_p50_ms'], '{:.0f}')} / {_f(c['ttft_p95_ms'], '{:.0f}')} | "
                         f"{_f(c['itl_p50_ms'])} / {_f(c['itl_p95_ms'])} | "
                         f"{_f(sp.get('acceptance_rate'), '{:.3f}')} | {_f(sp.get('mean_accepted_length'), '{:.2f}')} | "
                         f"{_f(c.get('peak_rss_mib'), '{:.0f}')} |")
        lines += ["", f"## {t}: per kind and number of users", "",
                  "| kind | users | config | aggregate tok/s | per-user tok/s | speedup | TTFT p50 ms | ITL p50 ms | "
                  "acceptance | mean len |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for c in tc:
            if c["kind"] == ALL:
                continue
            sp = c["spec"] or {}
            lines.append(f"| {c['kind']} | {c['users']} | {c['config']} | {_f(c['aggregate_tps'])} | "
                         f"{_f(c['per_user_tps'])} | {_x(c['speedup_aggregate'])} | {_f(c['ttft_p50_ms'], '{:.0f}')} | "
                         f"{_f(c['itl_p50_ms'])} | {_f(sp.get('acceptance_rate'), '{:.3f}')} | "
                         f"{_f(sp.get('mean_accepted_length'), '{:.2f}')} |")
        pos = [c for c in tc if c["kind"] == ALL and c["users"] == u0 and (c["spec"] or {}).get("acceptance_per_pos")]
        if pos:
            n = max(len(c["spec"]["acceptance_per_pos"]) for c in pos)
            lines += ["", f"## {t}: acceptance per draft position ({u0} user{'s' if u0 > 1 else ''}, all kinds)", "",
                      "| config | " + " | ".join(f"pos {i + 1}" for i in range(n)) + " |", "|---|" + "---:|" * n]
            for c in pos:
                pp = c["spec"]["acceptance_per_pos"]
                lines.append(f"| {c['config']} | " + " | ".join(_f(pp[i] if i < len(pp) else None, "{:.3f}")
                                                              for i in range(n)) + " |")
        nospec = [c for c in tc if c["config"] != "none" and c["kind"] == ALL and c["spec"] is None]
        if nospec:
            lines += ["", f"{t} reported no acceptance (no `timings` with draft_n in its responses and no speculative "
                          "counters in `/metrics`): acceptance columns are empty."]
        lines.append("")
    if s["peer"]:
        lines += ["## Side by side (ours / peer, same configuration, kind and users)", "",
                  "| peer | kind | users | config | aggregate ratio | per-user ratio |", "|---|---|---:|---|---:|---:|"]
        for p in sorted(s["peer"], key=lambda p: (p["peer"], p["kind"] != ALL, p["kind"], p["users"], p["config"])):
            lines.append(f"| {p['peer']} | {p['kind']} | {p['users']} | {p['config']} | {_x(p['aggregate_ratio'])} | "
                         f"{_x(p['per_user_ratio'])} |")
        lines.append("")
    lines += ["## Lossless check", ""]
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
    lines += ["", "Plots: " + ", ".join(f"![{p}]({p})" for p in PLOTS), ""]
    return "\n".join(lines)


def _find(cells, cfg, kind, users):
    return next((c for c in cells if c["config"] == cfg and c["kind"] == kind and c["users"] == users), None)


def draw_plots(out_dir: Path, results: dict, s: dict) -> list[Path]:
    """speedup.png (speedup by kind and configuration, fewest users), users.png (aggregate tokens/s
    against users, with and without speculation, crossover marked), acceptance.png (acceptance per
    draft position). Each PLOT_SIZE at PLOT_DPI; an empty plot says so rather than being skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = s["cells"]
    target = cells[0]["target"] if cells else None
    tc = [c for c in cells if c["target"] == target]
    paths = []

    fig, ax = plt.subplots(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    if tc:
        u0 = min(c["users"] for c in tc)
        configs = [c for c in dict.fromkeys(c["config"] for c in tc) if c != "none"]
        kinds = list(dict.fromkeys(c["kind"] for c in tc))
        width = 0.8 / max(1, len(configs))
        for j, cfg in enumerate(configs):
            vals = [(_find(tc, cfg, k, u0) or {}).get("speedup_aggregate") or 0.0 for k in kinds]
            ax.bar([i + j * width for i in range(len(kinds))], vals, width, label=cfg)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(kinds))], kinds, rotation=30, ha="right")
        ax.set_ylabel("speedup vs no speculation")
        ax.set_title(f"{target}: speedup by kind and draft length ({u0} user{'s' if u0 > 1 else ''})")
        if configs:
            ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no finished phase", ha="center")
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "speedup.png", plt))

    fig, ax = plt.subplots(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    all_c = [c for c in tc if c["kind"] == ALL]
    for cfg in dict.fromkeys(c["config"] for c in all_c):
        pts = sorted((c["users"], c["aggregate_tps"]) for c in all_c if c["config"] == cfg and c["aggregate_tps"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=cfg,
                    linestyle="--" if cfg == "none" else "-", color="black" if cfg == "none" else None)
    cross = (s["crossover"].get(target) or {}).get(ALL) if target else None
    if cross and cross.get("stops_at") is not None:
        ax.axvline(cross["stops_at"], color="red", linestyle=":", label=f"stops paying at {cross['stops_at']} users")
    ax.set_xlabel("concurrent users")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_title(f"{target}: aggregate tokens/s against users (all kinds)")
    if all_c:
        ax.set_xticks(sorted({c["users"] for c in all_c}))
        ax.legend(fontsize="small")
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "users.png", plt))

    fig, ax = plt.subplots(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    drawn = False
    if tc:
        u0 = min(c["users"] for c in tc)
        for c in tc:
            pp = (c["spec"] or {}).get("acceptance_per_pos") if c["kind"] == ALL and c["users"] == u0 else None
            if pp:
                ax.plot(range(1, len(pp) + 1), pp, marker="o", label=c["config"])
                drawn = True
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{target}: acceptance per draft position (all kinds)")
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no acceptance reported", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "acceptance.png", plt))
    return paths


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return path


def load_results(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "results.json").read_text())
