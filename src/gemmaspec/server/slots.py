"""llama-server's slot save / restore / erase (``POST /slots/{id}?action=...`` with ``--slot-save-path``).

A slot's prompt cache (the tokens it holds and their keys and values, see
:class:`~gemmaspec.server.scheduler.Slot`) is written to a file in the save directory and read back
into a slot later, so a long shared prefix (a system prompt, a document) is computed once and survives
restarts; the next request whose prompt starts with those tokens reuses them (``timings.cache_n``).
The functions here run on the scheduler thread (:meth:`~gemmaspec.server.scheduler.Scheduler.slot_action`),
when the slot is free.

The file is ``torch.save`` of a dict (loaded back with ``weights_only=True``: tensors and plain
values only): ``format``, ``model`` (the file name it was computed with), ``capacity``, ``tokens``,
``length``, ring-buffer bookkeeping, and per layer ``(k, v)`` (full-attention layers: the first
``length`` rows; sliding-window rings: every row) or None. Responses are llama-server's:
``{"id_slot", "filename", "n_saved", "n_written", "timings": {"save_ms"}}``,
``{"id_slot", "filename", "n_restored", "n_read", "timings": {"restore_ms"}}``, ``{"id_slot", "n_erased"}``.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import torch

from ..errors import InputError

FORMAT = "gemmaspec-slot-1"


def check_filename(name) -> str:
    """A file name for the save directory: no directories, no leading dot, at most 255 bytes.

    Raises:
        InputError: anything else (so a request cannot reach outside ``--slot-save-path``).
    """
    if not isinstance(name, str) or not name:
        raise InputError("'filename' is required: the name of the file in --slot-save-path")
    if (len(name.encode()) > 255 or name.startswith(".") or not re.fullmatch(r"[^/\\\x00-\x1f:*?\"<>|]+", name)):
        raise InputError(f"invalid 'filename' {name!r}: a plain file name (no directories, no leading dot, "
                         "no control or reserved characters)")
    return name


def save(slot, path: Path, model: str) -> dict:
    """Write ``slot``'s cached tokens and their K/V to ``path``; llama-server's response fields."""
    t0 = time.perf_counter()
    cache, n = slot.cache, len(slot.cached)
    layers = []
    for lay in cache.layers:
        if lay is None:
            layers.append(None)
        elif lay.window is not None:  # a ring: positions live modulo its rows
            layers.append((lay.k.clone(), lay.v.clone()))
        else:
            layers.append((lay.k[:n].clone(), lay.v[:n].clone()))
    state = {"format": FORMAT, "model": model, "capacity": cache.capacity, "tokens": list(slot.cached),
             "length": n, "ring_rows": cache.ring_rows or 0, "slot_pos": cache.slot_pos.clone(), "layers": layers}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return {"id_slot": slot.index, "filename": path.name, "n_saved": n, "n_written": path.stat().st_size,
            "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}


def restore(slot, path: Path, model: str) -> dict:
    """Read ``path`` into ``slot`` (its tokens become the slot's prompt cache).

    Raises:
        InputError: no such file, not a slot file, or one saved from another model or cache shape.
    """
    t0 = time.perf_counter()
    if not path.is_file():
        raise InputError(f"no saved slot named {path.name!r} in --slot-save-path")
    try:
        state = torch.load(path, map_location=slot.cache.device, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's
        raise InputError(f"{path.name!r} is not a saved slot ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise InputError(f"{path.name!r} is not a gemmaspec slot file")
    if state["model"] != model:
        raise InputError(f"{path.name!r} was saved with model {state['model']}, this server runs {model}")
    cache, n = slot.cache, state["length"]
    shapes_ok = (len(state["layers"]) == len(cache.layers) and n <= cache.capacity and n == len(state["tokens"])
                 and state["ring_rows"] == (cache.ring_rows or 0))
    for lay, saved in zip(cache.layers, state["layers"]) if shapes_ok else ():
        if (lay is None) != (saved is None) or lay is not None and (
                saved[0].shape[1:] != lay.k.shape[1:] or saved[0].shape[0] != (lay.rows if lay.window is not None else n)):
            shapes_ok = False
    if not shapes_ok:
        raise InputError(f"{path.name!r} was saved with another context size or cache layout")
    for lay, saved in zip(cache.layers, state["layers"]):
        if lay is not None:
            lay.k[:saved[0].shape[0]].copy_(saved[0])
            lay.v[:saved[1].shape[0]].copy_(saved[1])
    cache.reset()
    cache.length = cache._high = n
    if cache.ring_rows:
        cache.slot_pos.copy_(state["slot_pos"])
    slot.cached = list(state["tokens"])
    return {"id_slot": slot.index, "filename": path.name, "n_restored": n, "n_read": path.stat().st_size,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}


def erase(slot) -> dict:
    """Forget ``slot``'s prompt cache."""
    n = len(slot.cached)
    slot.cached = []
    slot.cache.reset()
    return {"id_slot": slot.index, "n_erased": n}
