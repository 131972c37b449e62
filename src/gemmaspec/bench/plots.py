"""The PNG plots of ``gemmaspec bench``, drawn from the summary alone (matplotlib's Agg canvas, no
display needed).

Each figure has one panel per (target, drafter), stacked; within a panel every series (a draft
length, or no speculation) has its own colour, the same draft length the same colour in every panel.
Legends sit right of the panels, outside the data. Bars carry their values; error bars and bands are
the spread over repeats (:data:`BAND`). Speedup and tokens/s axes start at 0, with 1.0x drawn as a
reference line; draft positions and user counts get integer ticks; a single user count is drawn as
bars, never as a one-point line.

- ``speedup.png``: aggregate speedup by kind (bars: draft lengths), fewest users.
- ``users.png``: aggregate tokens/s against users (lines with bands, no speculation dashed, where the
  drafter stops paying marked), or bars when one user count was measured.
- ``acceptance.png``: acceptance by draft position (bars: draft lengths), fewest users, all kinds.
"""

from __future__ import annotations

from pathlib import Path

from .analyze import ALL, NOISE, crossover

PLOT_SIZE = (8.0, 4.5)  # inches, a one-panel figure; more panels add PANEL_HEIGHT each, many bars add width
PLOT_DPI = 100  # so a one-panel figure is 800 x 450 pixels
PANEL_HEIGHT = 3.0
PLOTS = ("speedup.png", "users.png", "acceptance.png")
BAND = "min to max over repeats"
REFERENCE = "reference"  # gid of the artists that are not data (1.0x line, noise band, crossover mark)
BASELINE_COLOUR = "black"


def drafter_of(config: str) -> str | None:
    """``ngram-simple n=3`` -> ``ngram-simple``; ``none`` -> None."""
    return None if config == "none" else config.rsplit(" n=", 1)[0]


def length_of(config: str) -> str:
    """``ngram-simple n=3`` -> ``3``; ``none`` -> ``0``."""
    return "0" if config == "none" else config.rsplit(" n=", 1)[-1]


def _length_key(n: str):
    return (0, int(n), "") if n.isdigit() else (1, 0, n)


def palette(n: int) -> list:
    """``n`` distinct colours: tab10 without its grey (kept apart from the reference artists) up to 9,
    else evenly spaced along a perceptual colour map."""
    import matplotlib

    if n <= 9:
        base = [c for i, c in enumerate(matplotlib.colormaps["tab10"].colors) if i != 7]
        return base[:n]
    cmap = matplotlib.colormaps["turbo"]
    return [cmap(0.05 + 0.9 * i / (n - 1)) for i in range(n)]


def panels(summary: dict, results: dict | None = None) -> list[tuple[str, str]]:
    """The (target, drafter) panels, targets in run order, drafters in the order of ``settings.configs``."""
    cells = summary["cells"]
    order = [drafter_of(c) for c in ((results or {}).get("settings") or {}).get("configs") or []]
    rank = {d: i for i, d in enumerate(dict.fromkeys(d for d in order if d))}
    targets = list(dict.fromkeys(c["target"] for c in cells))
    out = []
    for t in targets:
        ds = {drafter_of(c["config"]) for c in cells if c["target"] == t} - {None}
        out += [(t, d) for d in sorted(ds, key=lambda d: (rank.get(d, len(rank)), d))]
    return out


def _colours(cells: list[dict]) -> dict[str, object]:
    """Draft length -> colour, shared by every panel of a figure."""
    lengths = sorted({length_of(c["config"]) for c in cells if c["config"] != "none"}, key=_length_key)
    return dict(zip(lengths, palette(len(lengths))))


def _configs(cells: list[dict], target: str, drafter: str, users: int | None = None) -> list[str]:
    cfgs = {c["config"] for c in cells if c["target"] == target and drafter_of(c["config"]) == drafter
            and (users is None or c["users"] == users)}
    return sorted(cfgs, key=lambda c: _length_key(length_of(c)))


def _fewest_users(cells: list[dict], target: str) -> int:
    return min(c["users"] for c in cells if c["target"] == target)


def _find(cells, target, cfg, kind, users):
    return next((c for c in cells if (c["target"], c["config"], c["kind"], c["users"]) == (target, cfg, kind, users)),
                None)


def _figure(n_panels: int, max_bars: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width = max(PLOT_SIZE[0], min(20.0, 2.5 + 0.16 * max_bars))
    fig = Figure(figsize=(width, PLOT_SIZE[1] + PANEL_HEIGHT * max(0, n_panels - 1)), dpi=PLOT_DPI,
                 layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(max(1, n_panels), 1, squeeze=False)[:, 0])


def _legend(ax) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0.0)


def _err(vals, spreads):
    lo = [v - (s[0] if s else v) for v, s in zip(vals, spreads)]
    hi = [(s[1] if s else v) - v for v, s in zip(vals, spreads)]
    return [[max(0.0, x) for x in lo], [max(0.0, x) for x in hi]]


def _bars(ax, xs, vals, spreads, width, colour, label, fmt, rotate) -> None:
    """One bar series with its spread as error bars and each value written on its bar."""
    bars = ax.bar(xs, vals, width, yerr=_err(vals, spreads) if any(spreads) else None, color=colour, label=label,
                  capsize=2, error_kw={"elinewidth": 0.8, "ecolor": "0.25"})
    ax.bar_label(bars, labels=[fmt.format(v) for v in vals], fontsize=7, padding=2,
                 rotation=90 if rotate else 0)


def _users(u: int) -> str:
    return f"{u} user{'s' if u != 1 else ''}"


def _note(ax, text: str) -> None:
    """A panel with nothing to draw says so, without axes (whose default ticks would mean nothing)."""
    ax.set_axis_off()
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def speedup_figure(summary: dict, results: dict | None = None):
    """Aggregate speedup by kind, one panel per (target, drafter) at the target's fewest users; bars
    are draft lengths with their spread, the 1.0x line and the ±NOISE band drawn."""
    cells = summary["cells"]
    pans = panels(summary, results)
    kinds_of = {t: list(dict.fromkeys(c["kind"] for c in cells if c["target"] == t)) for t, _ in pans}
    nbars = [len(kinds_of[t]) * len(_configs(cells, t, d)) for t, d in pans]
    fig, axes = _figure(len(pans), max(nbars, default=0))
    colours = _colours(cells)
    top = 1.1
    for ax, (t, d), nb in zip(axes, pans, nbars):
        u0 = _fewest_users(cells, t)
        kinds, cfgs = kinds_of[t], _configs(cells, t, d, u0)
        width = 0.8 / max(1, len(cfgs))
        for j, cfg in enumerate(cfgs):
            pts = [(i, c) for i, k in enumerate(kinds) for c in [_find(cells, t, cfg, k, u0)]
                   if c and c["speedup_aggregate"] is not None]
            if not pts:
                continue
            vals = [c["speedup_aggregate"] for _, c in pts]
            spreads = [c.get("speedup_aggregate_range") for _, c in pts]
            top = max([top] + [s[1] if s else v for v, s in zip(vals, spreads)])
            _bars(ax, [i - 0.4 + width * (j + 0.5) for i, _ in pts], vals, spreads, width,
                  colours[length_of(cfg)], f"n={length_of(cfg)}", "{:.2f}", nb > 12)
        ax.axhspan(1 - NOISE, 1 + NOISE, color="0.88", zorder=0, gid=REFERENCE, label=f"±{NOISE:.0%}: within noise")
        ax.axhline(1.0, color=BASELINE_COLOUR, linewidth=0.9, linestyle="--", gid=REFERENCE,
                   label="no speculation (1.00x)")
        ax.set_xticks(range(len(kinds)), kinds, rotation=30 if len(kinds) > 6 else 0,
                      ha="right" if len(kinds) > 6 else "center")
        ax.set_ylabel("speedup (aggregate)")
        ax.set_title(f"{t}: {d} ({_users(u0)})", fontsize="medium")
        _legend(ax)
    fig.suptitle(f"Aggregate speedup against no speculation, by kind and draft length (error bars: {BAND})",
                 fontsize="medium")
    if not pans:
        _note(axes[0], "no finished phase")
    for ax in axes:
        ax.set_ylim(0, top * (1.22 if max(nbars, default=0) > 12 else 1.12))
    return fig


def _users_lines(ax, cells, t, d, users, colours) -> None:
    cfgs = ["none"] + _configs(cells, t, d)
    for cfg in cfgs:
        pts = sorted((c["users"], c) for c in cells if c["target"] == t and c["config"] == cfg and c["kind"] == ALL
                     and c["aggregate_tps"])
        if not pts:
            continue
        xs, cs = [u for u, _ in pts], [c for _, c in pts]
        colour = BASELINE_COLOUR if cfg == "none" else colours[length_of(cfg)]
        ax.plot(xs, [c["aggregate_tps"] for c in cs], marker="o", color=colour, label=cfg,
                linestyle=("--" if cfg == "none" else "-") if len(xs) > 1 else "none")
        rng = [c.get("aggregate_tps_range") or [c["aggregate_tps"]] * 2 for c in cs]
        if len(xs) > 1:
            ax.fill_between(xs, [r[0] for r in rng], [r[1] for r in rng], color=colour, alpha=0.15, linewidth=0)
    own = [c for c in cells if c["target"] == t and (c["config"] == "none" or drafter_of(c["config"]) == d)]
    stop = (crossover(own, t).get(ALL) or {}).get("stops_at")
    if stop is not None:
        ax.axvline(stop, color="red", linestyle=":", gid=REFERENCE,
                   label="never pays outside noise" if stop == users[0] else f"stops paying at {_users(stop)}")
    ax.set_xticks(users, [str(u) for u in users])
    ax.set_xlabel("concurrent users")
    ax.set_title(f"{t}: {d}", fontsize="medium")
    _legend(ax)


def _users_bars(ax, cells, t, d, u, colours) -> None:
    cfgs = ["none"] + _configs(cells, t, d, u)
    cs = [(cfg, _find(cells, t, cfg, ALL, u)) for cfg in cfgs]
    cs = [(cfg, c) for cfg, c in cs if c and c["aggregate_tps"]]
    for i, (cfg, c) in enumerate(cs):
        _bars(ax, [i], [c["aggregate_tps"]], [c.get("aggregate_tps_range")], 0.7,
              BASELINE_COLOUR if cfg == "none" else colours[length_of(cfg)], cfg, "{:.1f}", False)
    ax.set_xticks(range(len(cs)), [length_of(cfg) if cfg != "none" else "none" for cfg, _ in cs])
    ax.set_xlabel("draft length")
    ax.set_title(f"{t}: {d} ({_users(u)}, the only user count measured: bars, not a one-point line)",
                 fontsize="medium")


def users_figure(summary: dict, results: dict | None = None):
    """Aggregate tokens/s (all kinds) against users, one panel per (target, drafter): lines with
    bands when two or more user counts were measured, bars at the one count otherwise."""
    cells = summary["cells"]
    pans = panels(summary, results)
    fig, axes = _figure(len(pans), 0)
    colours = _colours(cells)
    top = 0.0
    for ax, (t, d) in zip(axes, pans):
        users = sorted({c["users"] for c in cells if c["target"] == t and c["kind"] == ALL})
        if not users:
            _note(ax, f"{t}: no repeat covered every kind")
            continue
        if len(users) > 1:
            _users_lines(ax, cells, t, d, users, colours)
        else:
            _users_bars(ax, cells, t, d, users[0], colours)
        ax.set_ylabel("aggregate output tokens/s")
        top = max([top] + [(c.get("aggregate_tps_range") or [0, c["aggregate_tps"] or 0])[1] for c in cells
                           if c["target"] == t and c["kind"] == ALL])
    fig.suptitle(f"Aggregate output tokens/s, all kinds (bands and error bars: {BAND})", fontsize="medium")
    if not pans:
        _note(axes[0], "no finished phase")
    for ax in axes:
        ax.set_ylim(0, max(1.0, top) * 1.12)
    return fig


def acceptance_figure(summary: dict, results: dict | None = None):
    """Acceptance by draft position (all kinds, fewest users), one panel per (target, drafter); bars
    are draft lengths. Acceptance is pooled over repeats (counters, not timings): no spread."""
    cells = summary["cells"]
    pans = panels(summary, results)
    per = {}
    for t, d in pans:
        u0 = _fewest_users(cells, t)
        rows = [(cfg, (c["spec"] or {}).get("acceptance_per_pos")) for cfg in _configs(cells, t, d, u0)
                for c in [_find(cells, t, cfg, ALL, u0)] if c]
        per[(t, d)] = (u0, [(cfg, pp) for cfg, pp in rows if pp])
    nbars = [sum(len(pp) for _, pp in rows) for _, rows in per.values()]
    fig, axes = _figure(len(pans), max(nbars, default=0))
    colours = _colours(cells)
    for ax, (t, d), nb in zip(axes, pans, nbars):
        u0, rows = per[(t, d)]
        ax.set_title(f"{t}: {d} ({_users(u0)})", fontsize="medium")
        if not rows:
            _note(ax, "no acceptance reported")
            continue
        npos = max(len(pp) for _, pp in rows)
        width = 0.8 / len(rows)
        at = [sum(len(pp) > i for _, pp in rows) for i in range(npos)]  # bars at each position, packed centred
        for j, (cfg, pp) in enumerate(rows):
            slot = [sum(len(q) > i for _, q in rows[:j]) for i in range(len(pp))]
            xs = [i + 1 + width * (slot[i] - (at[i] - 1) / 2) for i in range(len(pp))]
            _bars(ax, xs, [v or 0.0 for v in pp], [None] * len(pp), width, colours[length_of(cfg)],
                  f"n={length_of(cfg)}", "{:.2f}", nb > 12)
        ax.set_xticks(range(1, npos + 1), [str(i) for i in range(1, npos + 1)])
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance")
        ax.set_ylim(0, 1.25 if nb > 12 else 1.12)
        _legend(ax)
    fig.suptitle("Acceptance by draft position, all kinds (pooled counters: no spread)", fontsize="medium")
    if not pans:
        _note(axes[0], "no acceptance reported")
    return fig


def draw_plots(out_dir: Path, results: dict, summary: dict) -> list[Path]:
    """Write :data:`PLOTS` into ``out_dir``; returns their paths. An empty figure says so rather than
    being skipped."""
    paths = []
    for name, make in zip(PLOTS, (speedup_figure, users_figure, acceptance_figure)):
        fig = make(summary, results)
        fig.savefig(out_dir / name, dpi=PLOT_DPI)
        paths.append(out_dir / name)
    return paths
