"""Preallocated KV cache with rollback, for one sequence.

Full-attention layers keep every position in a buffer of ``capacity`` rows. Sliding-window layers
keep a ring buffer of ``window + max_rollback`` rows: a query at position p sees keys p-window+1..p
(transformers ``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``), and the
extra ``max_rollback`` rows keep the keys that a rollback of up to that many positions needs again,
even after the window has wrapped.

Layout per layer: keys and values float32 [rows, num_kv_heads, head_dim].
"""

from __future__ import annotations

import torch


class LayerKV:
    """One layer's keys and values. ``window`` None means full attention (no ring)."""

    def __init__(self, rows: int, num_kv_heads: int, head_dim: int, window: int | None, device, dtype):
        self.rows = rows
        self.window = window
        self.k = torch.zeros(rows, num_kv_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def attend_kv(self, start: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Store the new keys/values for positions start.. and return what the new queries see.

        Args:
            start: position of the first new token (= number of tokens already cached).
            k_new, v_new: float32 [T, num_kv_heads, head_dim].

        Returns:
            ``(k, v, key_pos)``: keys/values [L, num_kv_heads, head_dim] and their positions
            int64 [L]; the caller masks by position (causal, and the window for sliding layers).
        """
        t = k_new.shape[0]
        dev = k_new.device
        if self.window is None:
            self.k[start:start + t] = k_new
            self.v[start:start + t] = v_new
            end = start + t
            return self.k[:end], self.v[:end], torch.arange(end, device=dev)
        first = max(0, start - self.window + 1)
        if first < start:
            old_pos = torch.arange(first, start, device=dev)
            idx = old_pos % self.rows
            k = torch.cat([self.k[idx], k_new])
            v = torch.cat([self.v[idx], v_new])
            pos = torch.cat([old_pos, torch.arange(start, start + t, device=dev)])
        else:
            k, v, pos = k_new, v_new, torch.arange(start, start + t, device=dev)
        keep = min(t, self.rows)  # earlier ones would be overwritten within this same write
        new_pos = torch.arange(start + t - keep, start + t, device=dev)
        slots = new_pos % self.rows
        self.k[slots] = k_new[t - keep:]
        self.v[slots] = v_new[t - keep:]
        return k, v, pos


class KVCache:
    """KV cache of a whole model for one sequence.

    Args:
        layer_windows: per layer, the sliding window (int) or None for full attention.
        capacity: the most positions the sequence may reach (the context size, ``-c``).
        num_kv_heads, head_dim: per-layer K/V shape.
        max_rollback: how many positions :meth:`rollback` may undo beyond the furthest position
            ever written (default 16, enough for speculative rounds of up to 15 draft tokens).

    The cache holds ``length`` positions; a model forward over T tokens starts at ``length`` and
    advances it by T.
    """

    def __init__(self, layer_windows, capacity: int, num_kv_heads: int, head_dim: int,
                 max_rollback: int = 16, device="cpu", dtype=torch.float32):
        self.capacity = capacity
        self.max_rollback = max_rollback
        self.layers = []
        for w in layer_windows:
            rows = capacity if w is None else min(capacity, w + max_rollback)
            self.layers.append(LayerKV(rows, num_kv_heads, head_dim, None if w is None or rows >= capacity else w,
                                       device, dtype))
        self.length = 0
        self._high = 0  # furthest position count ever written since reset

    def advance(self, t: int) -> None:
        """Mark t more positions as written (called by the model after a forward)."""
        self.length += t
        self._high = max(self._high, self.length)

    def rollback(self, new_length: int) -> None:
        """Forget every position from ``new_length`` on.

        Raises:
            ValueError: new_length is negative or beyond ``length``, or it undoes more than
                ``max_rollback`` positions of a sliding-window layer's ring.
        """
        if not 0 <= new_length <= self.length:
            raise ValueError(f"cannot roll back to {new_length}: cache holds {self.length} positions")
        ring = any(layer.window is not None for layer in self.layers)
        if ring and self._high - new_length > self.max_rollback:
            raise ValueError(
                f"cannot roll back {self._high - new_length} positions: the sliding-window cache keeps "
                f"{self.max_rollback}; build the cache with a larger max_rollback")
        self.length = new_length

    def reset(self) -> None:
        """Empty the cache (keeps its memory)."""
        self.length = 0
        self._high = 0
