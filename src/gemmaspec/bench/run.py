"""The sweep: every (repeat, kind, users, configuration, target) phase, one at a time.

A phase runs one kind's prompts with ``users`` closed-loop users (each sends its next request when
its previous one is answered); the request list is the kind's prompts cycled up to a multiple of
``users``, so every user stays busy to the end. Within each (repeat, kind, users) the configurations
take turns, and a peer target runs right after ours, so drift on a shared machine hits every
configuration alike. ``results.json`` is rewritten (atomically) after every phase, so an interrupted
or killed run leaves a valid file with every phase that finished.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .suite import Prompt
from .targets import BenchTargetError, spec_label

SCHEMA = 1


@dataclass(frozen=True)
class Config:
    """One speculative setting: ``spec_type`` and ``n_max`` (0 = no speculation, labelled ``none``)."""

    spec_type: str
    n_max: int | str

    @property
    def label(self) -> str:
        return spec_label(self.spec_type, self.n_max)


def machine() -> dict:
    """CPU model, cores, Python, platform, and the kernel path gemmaspec built for this CPU."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
           "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    try:
        import torch

        out["torch"] = torch.__version__
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return out


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("gemmaspec", "torch", "numpy", "httpx", "matplotlib"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (a temporary file renamed over the old one)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def plan(prompts: list[Prompt], users: list[int], configs: list[Config], targets: list, repeats: int) -> list[tuple]:
    """The phases in run order: ``(repeat, kind, users, config, target)``."""
    kinds = list(dict.fromkeys(p.kind for p in prompts))
    out = []
    for rep in range(repeats):
        for kind in kinds:
            for u in users:
                for cfg in configs:
                    for t in targets:
                        if u > 1 and getattr(t, "single_user", False):
                            continue
                        can = getattr(t, "can_speculate", None)  # a peer that has only some drafters
                        if cfg.n_max != 0 and can is not None and cfg.spec_type not in can:
                            continue
                        out.append((rep, kind, u, cfg, t))
    return out


def requests_for(prompts: list[Prompt], users: int) -> list[Prompt]:
    """The kind's prompts cycled up to a multiple of ``users``."""
    n = -(-len(prompts) // users) * users
    return [prompts[i % len(prompts)] for i in range(n)]


def run_phase(target, prompts: list[Prompt], users: int, cfg: Config, max_tokens: int, temp: float, seed: int,
              stop: threading.Event, progress=None) -> dict:
    """Run one phase; returns its record (``wall_s``, ``requests``, ``metrics_delta``).

    Raises:
        KeyboardInterrupt: interrupted (the phase is incomplete and must be dropped).
        BenchTargetError: a request failed.
    """
    todo = requests_for(prompts, users)
    lock = threading.Lock()
    nxt = [0]
    done: list[dict] = []
    errors: list[BaseException] = []
    before = target.counters()
    plan_before = target.plan_totals() if hasattr(target, "plan_totals") else None

    def user(u: int):
        while not stop.is_set():
            with lock:
                if nxt[0] >= len(todo):
                    return
                i = nxt[0]
                nxt[0] += 1
            p = todo[i]
            try:
                mt = min(max_tokens, p.max_tokens) if p.max_tokens else max_tokens
                r = target.request(p, cfg.spec_type, cfg.n_max, mt, temp, seed + p.index, stop)
            except KeyboardInterrupt:
                return
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)
                stop.set()
                return
            r.update(kind=p.kind, index=p.index, user=u, seq=i)
            with lock:
                done.append(r)
            if progress is not None:
                progress(1)

    threads = [threading.Thread(target=user, args=(u,), daemon=True) for u in range(users)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    try:
        for th in threads:
            while th.is_alive():
                th.join(0.1)
    except KeyboardInterrupt:
        stop.set()
        for th in threads:
            th.join(30)
        raise
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0] if isinstance(errors[0], BenchTargetError) else BenchTargetError(
            f"{target.name}: a request failed: {type(errors[0]).__name__}: {errors[0]}")
    if stop.is_set() or len(done) < len(todo):
        raise KeyboardInterrupt
    rec = {"wall_s": wall, "requests": sorted(done, key=lambda r: r["seq"])}
    after = target.counters() if before is not None else None
    if before is not None and after is not None:
        rec["metrics_delta"] = counter_delta(before, after)
    if plan_before is not None:  # the rounds whose draft lengths were chosen: predicted vs measured
        plan_after = target.plan_totals()
        if plan_after is not None:
            rec["planner"] = plan_delta(plan_before, plan_after)
    if hasattr(target, "memory"):
        rec["memory"] = target.memory()
    return rec


def plan_delta(before: dict, after: dict) -> dict:
    """A phase's share of the planner totals (``rounds``, ``predicted_tokens``, ``predicted_seconds``,
    ``tokens``, ``seconds``, and ``chosen_n`` {n: slot-rounds} where the target reports it)."""
    out = {k: v - before.get(k, 0) for k, v in after.items() if not isinstance(v, dict)}
    if "chosen_n" in after:
        b = before.get("chosen_n") or {}
        out["chosen_n"] = {n: c - b.get(n, 0) for n, c in after["chosen_n"].items() if c - b.get(n, 0)}
    return out


def plan_summary(results: dict) -> str:
    """One line for report.md: per configuration and user count whose draft lengths were chosen, the
    mean length chosen and the cost model's tokens/s against the measured (of those rounds); "" when
    none was."""
    acc: dict[tuple, dict] = {}
    for ph in results.get("phases", []):
        pl = ph.get("planner") or {}
        if not pl.get("rounds"):
            continue
        a = acc.setdefault((ph["config"], ph["users"]), {"pt": 0.0, "ps": 0.0, "t": 0.0, "s": 0.0, "n": {}})
        a["pt"] += pl["predicted_tokens"]
        a["ps"] += pl["predicted_seconds"]
        a["t"] += pl["tokens"]
        a["s"] += pl["seconds"]
        for n, c in (pl.get("chosen_n") or {}).items():
            a["n"][int(n)] = a["n"].get(int(n), 0) + c
    parts = []
    for (cfg, users), a in sorted(acc.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        rounds = sum(a["n"].values())
        mean = f"mean n {sum(n * c for n, c in a['n'].items()) / rounds:.2f}, " if rounds else ""
        parts.append(f"{cfg}, {users} user(s): {mean}predicted {a['pt'] / a['ps']:.1f} tokens/s, measured "
                     f"{a['t'] / a['s']:.1f}" if a["ps"] and a["s"] else f"{cfg}, {users} user(s): -")
    return ("Draft lengths chosen per round (cost model's prediction vs measured, in those rounds): "
            + "; ".join(parts) + ".") if parts else ""


def counter_delta(before: dict, after: dict) -> dict:
    """``after - before`` for each counter (lists element-wise, a missing element counted 0)."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, list):
            b = list(b or [])
            out[k] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(v)]
        else:
            out[k] = v - (b or 0)
    return out


def sweep(out_dir: Path, prompts: list[Prompt], users: list[int], configs: list[Config], targets: list,
          repeats: int, max_tokens: int, temp: float, seed: int, settings: dict, progress: bool = True) -> dict:
    """Run every phase, rewriting ``out_dir/results.json`` after each; returns the results.

    On Ctrl-C (KeyboardInterrupt) the phase in flight is dropped and the results so far are returned
    with ``interrupted: true``; a failing target raises after writing what finished (``error`` set)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    results = {"schema": SCHEMA, "tool": "gemmaspec bench", "started": _dt.datetime.now().isoformat(timespec="seconds"),
               "machine": machine(), "versions": versions(), "settings": settings,
               "targets": [t.describe() for t in targets], "interrupted": False, "complete": False, "phases": []}
    write_json(path, results)
    by_kind: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_kind.setdefault(p.kind, []).append(p)
    phases = plan(prompts, users, configs, targets, repeats)
    total = sum(len(requests_for(by_kind[k], u)) for _, k, u, _, _ in phases)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="req", desc="bench", dynamic_ncols=True, smoothing=0.05)
    stop = threading.Event()
    try:
        for rep, kind, u, cfg, t in phases:
            if bar is not None:
                bar.set_description(f"{t.name} {kind} users={u} {cfg.label} rep {rep + 1}/{repeats}", refresh=False)
            rec = run_phase(t, by_kind[kind], u, cfg, max_tokens, temp, seed, stop,
                            progress=bar.update if bar is not None else None)
            results["phases"].append({"target": t.name, "config": cfg.label, "spec_type": cfg.spec_type,
                                      "n_max": cfg.n_max, "kind": kind, "users": u, "repeat": rep, **rec})
            write_json(path, results)
        results["complete"] = True
    except KeyboardInterrupt:
        results["interrupted"] = True
    except BenchTargetError as exc:
        results["error"] = str(exc)
        write_json(path, results)
        raise
    finally:
        if bar is not None:
            bar.close()
    results["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
    write_json(path, results)
    return results
