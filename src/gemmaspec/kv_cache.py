"""Preallocated KV cache with rollback, for one sequence.

Full-attention layers keep every position in a buffer of ``capacity`` rows. Sliding-window layers
keep a ring buffer of ``window + max_rollback`` rows: a query at position p sees keys p-window+1..p
(transformers ``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``), and the
extra ``max_rollback`` rows keep the keys that a rollback of up to that many positions needs again,
even after the window has wrapped.

Layout per layer: keys and values float32 [rows, num_kv_heads, head_dim].

A forward over T new tokens first asks :meth:`KVCache.plan` how the layers should read the cache;
the plan (masks, indices) is computed once and shared by every layer of the same kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReadPlan:
    """How one kind of layer (full or sliding) reads keys for T new tokens at ``start``.

    mode "prefix": keys are rows [0, end) (full layers; rings that have not wrapped).
    mode "ring": new keys are written into the ring first, then queries read all ring rows.
    mode "gather": old keys at ``old_idx`` are gathered and the new keys appended (long chunks).
    ``mask`` bool [T, L] (True = may attend) or None when every key is visible.
    """

    mode: str
    end: int = 0
    old_idx: torch.Tensor | None = None
    mask: torch.Tensor | None = None


def _zeros(shape: tuple[int, ...], device, dtype) -> torch.Tensor:
    """A zeroed tensor. On the CPU the memory is an anonymous private mapping (``mmap``): fresh pages
    the kernel zeroes on first touch, so a 40 MiB cache costs nothing until positions fill it
    (``torch.zeros`` writes every byte up front: ~0.1 s at start-up; ``calloc``, used before, takes
    blocks from the heap once glibc has raised its mmap threshold, and then zeroes, and so keeps
    resident, all of them: 24 MiB of the default model's 39.5 MiB cache at -c 4096)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    import mmap

    import numpy as np

    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = np.frombuffer(mmap.mmap(-1, n * itemsize), dtype=np.uint8)  # the array keeps the mapping alive
    return torch.from_numpy(buf).view(dtype).view(shape)


class LayerKV:
    """One layer's keys and values. ``window`` None means full attention (no ring)."""

    def __init__(self, rows: int, num_kv_heads: int, head_dim: int, window: int | None, device, dtype):
        self.rows = rows
        self.window = window
        self.k = _zeros((rows, num_kv_heads, head_dim), device, dtype)
        self.v = _zeros((rows, num_kv_heads, head_dim), device, dtype)

    def update(self, plan: ReadPlan, start: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Write the new keys/values [T, num_kv_heads, head_dim] for positions start.. into the cache and
        return ``(keys, values)`` [L, num_kv_heads, head_dim] that the plan's mask refers to (a view of
        the cache, or for mode "gather" a new tensor of the old rows then the new ones). It writes and
        reads in one call because mode "gather" must read the old rows before the ring write may
        overwrite them (transformers' ``Cache.update`` has the same contract)."""
        t = k_new.shape[0]
        if plan.mode == "prefix":
            self.k[start:start + t] = k_new
            self.v[start:start + t] = v_new
            return self.k[:plan.end], self.v[:plan.end]
        if plan.mode == "gather":
            k = torch.cat([self.k[plan.old_idx], k_new])
            v = torch.cat([self.v[plan.old_idx], v_new])
            self._write_ring(start, k_new, v_new)
            return k, v
        self._write_ring(start, k_new, v_new)
        return self.k, self.v

    def _write_ring(self, start: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        t = k_new.shape[0]
        keep = min(t, self.rows)  # earlier ones would be overwritten within this same write
        first = start + t - keep
        s0 = first % self.rows
        n1 = min(keep, self.rows - s0)
        self.k[s0:s0 + n1] = k_new[t - keep:t - keep + n1]
        self.v[s0:s0 + n1] = v_new[t - keep:t - keep + n1]
        if n1 < keep:
            self.k[:keep - n1] = k_new[t - keep + n1:]
            self.v[:keep - n1] = v_new[t - keep + n1:]


class KVCache:
    """KV cache of a whole model for one sequence.

    Args:
        layer_windows: per layer, the sliding window (int) or None for full attention.
        capacity: the most positions the sequence may reach (the context size, ``-c``).
        num_kv_heads, head_dim: per-layer K/V shape.
        shapes: optional per-layer ``(num_kv_heads, head_dim)`` overriding the two above, or None
            for a layer that keeps no K/V of its own (Gemma 4's KV-shared layers).
        max_rollback: how many positions :meth:`rollback` may undo beyond the furthest position
            ever written (default 16, enough for speculative rounds of up to 15 draft tokens).

    The cache holds ``length`` positions; a model forward over T tokens starts at ``length`` and
    advances it by T.
    """

    def __init__(self, layer_windows, capacity: int, num_kv_heads: int, head_dim: int,
                 max_rollback: int = 16, device="cpu", dtype=torch.float32, shapes=None):
        self.capacity = capacity
        self.max_rollback = max_rollback
        self.device = torch.device(device)
        self.layers = []
        self.window = None
        self.ring_rows = None
        for i, w in enumerate(layer_windows):
            shape = (num_kv_heads, head_dim) if shapes is None else shapes[i]
            if shape is None:  # a layer that reads another layer's K/V keeps none of its own
                self.layers.append(None)
                continue
            ring = w is not None and w + max_rollback < capacity
            rows = w + max_rollback if ring else capacity
            if ring:
                self.window, self.ring_rows = w, rows
            self.layers.append(LayerKV(rows, shape[0], shape[1], w if ring else None, self.device, dtype))
        self.length = 0
        self._high = 0  # furthest position count ever written since reset
        # position held by each ring row (-1: empty); identical for every ring layer
        self.slot_pos = torch.full((self.ring_rows or 0,), -1, dtype=torch.long, device=self.device)

    def plan(self, start: int, t: int, window: int | None) -> ReadPlan:
        """The read plan for layers with this ``window`` (None: full) for T tokens at ``start``.

        Call it for every window kind *before* :meth:`note_written` of the same forward.
        """
        dev = self.device
        end = start + t
        ring = window is not None and self.ring_rows is not None
        if (not ring or end <= self.ring_rows) and t == 1 and (window is None or end <= window):
            return ReadPlan("prefix", end=end)
        q_pos = torch.arange(start, start + t, device=dev)
        if not ring or end <= self.ring_rows:
            k_pos = torch.arange(end, device=dev)
            return ReadPlan("prefix", end=end, mask=self._mask(q_pos, k_pos, window))
        rows = self.ring_rows
        if t <= rows - window + 1:
            # writing first is safe: the rows overwritten hold positions no new query can see
            slot = self.slot_pos.clone()
            new_slots = torch.arange(start, end, device=dev) % rows
            slot[new_slots] = q_pos
            mask = self._mask(q_pos, slot, window) & (slot >= 0)[None, :]
            return ReadPlan("ring", mask=mask)
        first = max(0, start - window + 1)
        old = torch.arange(first, start, device=dev)
        k_pos = torch.cat([old, q_pos])
        return ReadPlan("gather", old_idx=old % rows, mask=self._mask(q_pos, k_pos, window))

    @staticmethod
    def _mask(q_pos, k_pos, window):
        diff = q_pos[:, None] - k_pos[None, :]
        allowed = diff >= 0
        if window is not None:
            allowed &= diff < window
        return allowed

    def advance(self, start: int, t: int) -> None:
        """Mark positions start..start+t-1 as written (called by the model after a forward)."""
        if self.ring_rows:
            keep = min(t, self.ring_rows)
            if keep <= 4 and self.device.type == "cpu":  # a decode or verify step: element writes, no tensor op
                view = self.slot_pos.numpy()
                for p in range(start + t - keep, start + t):
                    view[p % self.ring_rows] = p
            else:
                pos = torch.arange(start + t - keep, start + t, device=self.device)
                self.slot_pos[pos % self.ring_rows] = pos
        self.length = start + t
        self._high = max(self._high, self.length)

    def rollback(self, new_length: int) -> None:
        """Forget every position from ``new_length`` on.

        Raises:
            ValueError: new_length is negative or beyond ``length``, or it undoes more than
                ``max_rollback`` positions of a sliding-window layer's ring.
        """
        if not 0 <= new_length <= self.length:
            raise ValueError(f"cannot roll back to {new_length}: cache holds {self.length} positions")
        if self.ring_rows and self._high - new_length > self.max_rollback:
            raise ValueError(
                f"cannot roll back {self._high - new_length} positions: the sliding-window cache keeps "
                f"{self.max_rollback}; build the cache with a larger max_rollback")
        if self.ring_rows and new_length < self.length:  # rows past the new end hold positions that no longer exist
            self.slot_pos[self.slot_pos >= new_length] = -1
        self.length = new_length

    def reset(self) -> None:
        """Empty the cache (keeps its memory)."""
        self.length = 0
        self._high = 0
        self.slot_pos.fill_(-1)
