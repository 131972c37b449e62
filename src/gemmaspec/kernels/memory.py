"""Memory arithmetic, one place for the CPU and the GPU: the bytes of a tensor as the loader keeps it
(:func:`tensor_bytes`; on a GPU the device layout of :mod:`gemmaspec.kernels.cuda`,
:func:`layout_bytes`), of the KV cache (:func:`kv_cache_bytes`), of the working buffers of the
largest forward step (:func:`work_bytes`) and of the runtime (:func:`runtime_bytes`), from shapes and
types alone: nothing is allocated or read. :class:`DeviceMemory` adds up one model on a device.

The per-architecture parts (which tensors a model has, which layers keep a KV cache) live in
:mod:`gemmaspec.models.footprint`; ``gemmaspec fit`` (:mod:`gemmaspec.manage.fit`) adds up a whole
setup (target, drafter, slots) from a file's metadata with these functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .build import STORED_TYPES
from .cuda import FORMATS, KERNEL_MAX_ROWS, QTYPES, TILE_BYTES, qtype_name

CUDA_CONTEXT_BYTES = 512 << 20  # CUDA context + PyTorch/cuBLAS/Triton modules: an allowance, not measured here
CPU_RUNTIME_BYTES = 244 << 20
"""Resident memory of a gemmaspec process before it loads a model: Python, PyTorch 2.13 CPU, gemmaspec
and its compiled kernel (measured 222 MiB after ``import gemmaspec.loading.engine`` and ``load_library()``,
RSS after ``malloc_trim``, Linux x86-64, Python 3.11, in a long-lived venv; a fresh ``make`` venv
with newer libraries held ~42 MiB more at peak: the constant is the midpoint, so both stay within a
few percent)."""
TOKENIZER_BYTES_PER_TOKEN = 424
"""Resident bytes of a loaded tokenizer per vocabulary entry (measured: +106 MiB for the default
model's 262,144 tokens, the same setting as :data:`CPU_RUNTIME_BYTES`)."""

_CONVERTED = {"Q4_1": True, "Q5_1": True, "Q5_K": True}  # → int8 + scales (+ offsets), blocks of 32
_INT = {"I8": 1, "I16": 2, "I32": 4, "I64": 8, "U8": 1, "BOOL": 1}


def tensor_bytes(qtype: str, shape: tuple[int, ...], stored: int, device: str, from_gguf: bool = True) -> int:
    """Bytes of one tensor as the loader keeps it on ``device`` ("cpu" or "cuda").

    Args:
        qtype: the stored type's name (a GGML type such as ``"Q4_0"``, or ``"F32"``, ``"BF16"``, ``"I32"``).
        shape: the tensor's shape, torch order ([out, in] for a matrix).
        stored: its bytes in the file.
        device: "cpu" or "cuda".
        from_gguf: False for a checkpoint directory (safetensors), whose tensors are widened to float32.

    On the CPU a GGUF's F32 tensors and its matrices of :data:`~gemmaspec.kernels.STORED_TYPES` are
    the mapped file's own bytes; Q4_1 / Q5_1 / Q5_K matrices become int8 levels + float32 scales and
    offsets per 32 values; integer tensors int64; everything else float32. On CUDA a matrix takes
    :func:`layout_bytes`.

    Raises:
        ValueError: on CUDA, a matrix type with no device layout.
    """
    numel = math.prod(shape) if shape else 1
    if qtype in _INT:
        return 8 * numel  # integer tensors become int64
    if not from_gguf:
        return 4 * numel  # checkpoint directories are widened to float32
    if qtype == "F32":
        return stored
    if qtype in ("F16", "BF16") or len(shape) != 2:
        return 4 * numel
    if device == "cuda":
        return layout_bytes(qtype, shape[0], shape[1])
    if qtype in STORED_TYPES:
        return stored
    if qtype in _CONVERTED:
        return numel + (numel // 32) * 4 * (2 if _CONVERTED[qtype] else 1)
    return 4 * numel


def runtime_bytes(device: str, *vocab_sizes: int) -> int:
    """Bytes of the runtime on ``device``: on CUDA the context allowance (:data:`CUDA_CONTEXT_BYTES`);
    on the CPU the process before any model (:data:`CPU_RUNTIME_BYTES`) plus a loaded tokenizer of
    each of ``vocab_sizes`` entries (:data:`TOKENIZER_BYTES_PER_TOKEN` per entry)."""
    if device == "cuda":
        return CUDA_CONTEXT_BYTES
    return CPU_RUNTIME_BYTES + sum(TOKENIZER_BYTES_PER_TOKEN * v for v in vocab_sizes)


def layout_bytes(qtype, n: int, k: int) -> int:
    """Device bytes of an [N, K] tensor stored as ``qtype``: the device layout
    (:class:`~gemmaspec.kernels.cuda.DeviceQuantWeight`) for the GGML block types of
    :data:`~gemmaspec.kernels.cuda.QTYPES`; float32 (what the models compute with) for F32, F16 and
    BF16; 4 bytes per value for I32 (index tables).

    Raises:
        ValueError: a type with neither a layout nor a dense form here.
    """
    name = qtype_name(qtype)
    if name in ("F32", "F16", "BF16", "I32"):
        return 4 * n * k
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"tensor type {name} has no device layout; supported: {', '.join(QTYPES)}, F32, F16, BF16")
    if k % fmt.block:
        raise ValueError(f"{name} rows of {k} values: K must be a multiple of {fmt.block}")
    per_value = 4 + fmt.hb  # bits of lo + hi
    total = n * k * per_value // 8 + 2 * n * (k // fmt.superblock)
    if fmt.sub_scales:
        total += n * (k // fmt.group)
    if fmt.offsets:
        total += 2 * n * (k // fmt.superblock) + n * (k // fmt.group)
    return total


def kv_cache_bytes(layers, context: int, max_rollback: int = 16, dtype_bytes: int = 4) -> int:
    """Bytes of the KV cache (:class:`~gemmaspec.kv_cache.KVCache`) at ``context`` positions.

    Args:
        layers: one ``(kv_heads, head_dim, window or None)`` per layer that keeps its own K/V (a
            KV-shared layer keeps none and is left out).
        context: the cache capacity (``-c``).
        max_rollback: the ring's extra rows for rollback (the engine's default 16).
        dtype_bytes: 4 (float32 keys and values).

    A sliding layer keeps ``window + max_rollback`` rows when that is below ``context``, as the cache does.
    """
    total = 0
    for heads, dim, window in layers:
        rows = window + max_rollback if window is not None and window + max_rollback < context else context
        total += 2 * rows * heads * dim * dtype_bytes
    return total


@dataclass(frozen=True)
class DeviceMemory:
    """Device bytes a model needs. ``weights``: its tensors in the device layout; ``kv_cache``: at the
    context asked; ``work``: transient buffers of the largest step (a prefill chunk's activations,
    attention scores and probabilities, the tile buffer and its dequantization temporaries);
    ``runtime``: the CUDA context allowance (:data:`CUDA_CONTEXT_BYTES`). ``total`` adds them."""

    weights: int
    kv_cache: int
    work: int
    runtime: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.work + self.runtime

    def __add__(self, other: "DeviceMemory") -> "DeviceMemory":
        """Two models on one device (a target and its drafter): one runtime allowance, the larger work."""
        return DeviceMemory(self.weights + other.weights, self.kv_cache + other.kv_cache,
                            max(self.work, other.work), max(self.runtime, other.runtime))


def work_bytes(chunk: int, context: int, hidden: int, ffn: int, heads: int, head_dim: int, vocab: int,
               extra_width: int = 0, logit_rows: int = KERNEL_MAX_ROWS) -> int:
    """Transient device bytes of the largest forward step, float32: a prefill chunk of ``chunk``
    tokens against ``context`` keys (scores, mask result and probabilities [heads, chunk, context]),
    its widest activations (gate, up and their product [chunk, ffn]; ``extra_width`` for per-layer
    inputs [chunk, extra_width] x 3), a few [chunk, hidden] / [chunk, heads * head_dim] tensors,
    ``logit_rows`` rows of logits, and the tile buffer plus its dequantization temporaries (codes, a
    quarter of the buffer; scales). An estimate from the code's tensors, not a measurement."""
    f32 = 4
    attention = 3 * heads * chunk * context * f32
    acts = (3 * chunk * ffn + 3 * chunk * extra_width + 6 * chunk * max(hidden, heads * head_dim)) * f32
    logits = logit_rows * vocab * f32
    tiles = TILE_BYTES + TILE_BYTES // 4 + TILE_BYTES // 8
    return attention + acts + logits + tiles


def fmt_bytes(n: int) -> str:
    """``1.23 GiB`` / ``456.7 MiB``."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
