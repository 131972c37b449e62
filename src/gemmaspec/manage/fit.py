"""Will it fit? Memory of a target, its drafter, the KV cache of every slot and the working buffers,
from metadata alone (a GGUF header, or config.json + safetensors headers), before anything loads.

What is counted is what gemmaspec itself allocates (see docs/architecture.md):

- **weights**, as the loader keeps them. On the CPU: a GGUF's F32 tensors and its Q4_0 / Q8_0 /
  Q5_0 / Q4_K / Q6_K matrices are the mapped file's own bytes (resident once read; the tied output
  head reads all of the embedding every step); Q4_1 / Q5_1 / Q5_K matrices become int8 levels +
  float32 scales (+ offsets); F16 / BF16 and other tensors float32. A checkpoint directory is widened
  to float32. On CUDA: :func:`gemmaspec.kernels.memory.layout_bytes` per tensor (all of it:
  :func:`gemmaspec.kernels.memory.tensor_bytes`).
- **KV cache per slot** (float32, :func:`gemmaspec.kernels.memory.kv_cache_bytes`): sliding-window
  layers hold ``window + max_rollback`` rows, full layers the context; KV-shared layers hold nothing
  (they read their source layer's cache, counted once); an MTP assistant keeps none (it reads the
  target's). ``generate`` has one slot, ``serve`` ``-np``.
- **working buffers** of the largest step (:func:`gemmaspec.kernels.memory.work_bytes`: a 256-token
  prefill chunk against the full context, the widest activations, 16 rows of logits, the tile buffer).
- **runtime**: on the CPU the process before any model (Python, PyTorch, gemmaspec, the kernel
  library: :data:`~gemmaspec.kernels.memory.CPU_RUNTIME_BYTES`) plus the tokenizer
  (:data:`~gemmaspec.kernels.memory.TOKENIZER_BYTES_PER_TOKEN` per vocabulary entry); on CUDA the
  context allowance :data:`~gemmaspec.kernels.memory.CUDA_CONTEXT_BYTES`
  (:func:`~gemmaspec.kernels.memory.runtime_bytes`).

``benchmarks/fit_check.py`` compares the total with the resident memory of real runs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError
from ..kernels.memory import fmt_bytes, kv_cache_bytes, runtime_bytes, tensor_bytes
from ..models.base import MAX_ROLLBACK, PREFILL_CHUNK
from ..models.footprint import kv_layers, step_work_bytes



@dataclass(frozen=True)
class ModelInfo:
    """What the metadata says about one checkpoint."""

    path: Path
    role: str  # "target" | "assistant"
    arch: str
    config: object
    tensors: tuple[tuple[str, str, tuple[int, ...], int], ...]  # (name, type, shape torch order, stored bytes)
    is_gguf: bool

    @property
    def text(self):
        """The text configuration (an assistant's inner one)."""
        return getattr(self.config, "text", self.config)

    @property
    def context_length(self) -> int:
        return int(getattr(self.text, "context_length", 0) or 0)


def read_model(path: str | os.PathLike | None) -> ModelInfo:
    """Metadata of a GGUF file or checkpoint directory (None: the default model); reads headers only.

    Raises:
        ModelFileError / UnsupportedArchitectureError: as loading would.
    """
    from .default_model import default_model_path

    p = Path(path) if path else default_model_path()
    if p.is_dir():
        from ..loading.safetensors import hf_checkpoint

        arch, config, _, tensors = hf_checkpoint(p)
        rows = tuple((n, t.dtype, tuple(t.shape), t.nbytes) for n, t in tensors.items())
        return ModelInfo(p, arch.role, arch.name, config, rows, False)
    from ..loading.gguf import open_reader, read_config

    header = open_reader(p)
    arch, config = read_config(p, header)
    rows = tuple((t.name, t.tensor_type.name, tuple(t.shape), t.n_bytes) for t in header.tensors)
    return ModelInfo(p, arch.role, arch.name, config, rows, True)


def weight_bytes(m: ModelInfo, device: str) -> int:
    """Bytes of the model's weights as the loader keeps them on ``device`` ("cpu" or "cuda")."""
    return sum(tensor_bytes(qtype, shape, stored, device, m.is_gguf) for _, qtype, shape, stored in m.tensors)


def kv_bytes_per_slot(m: ModelInfo, ctx: int, dtype_bytes: int = 4) -> int:
    """KV-cache bytes of one sequence at ``ctx`` positions (0 for an assistant)."""
    if m.role != "target":
        return 0
    return kv_cache_bytes(kv_layers(m.config), ctx, MAX_ROLLBACK, dtype_bytes)


def buffer_bytes(m: ModelInfo, ctx: int) -> int:
    """Working buffers of the model's largest step at ``ctx`` (see the module docstring)."""
    rows = min(PREFILL_CHUNK, ctx) if m.role == "target" else 1
    return step_work_bytes(m.config, rows, ctx)


def parse_mem(text: str) -> int:
    """``8GiB`` / ``8G`` / ``8GB`` (10^9) / ``512MiB`` / ``512M`` / ``123456`` (bytes) → bytes.

    Raises:
        InputError: not a size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*", text, flags=re.I)
    if not m:
        raise InputError(f"--device must be cpu, cuda, auto or a memory size such as 8GiB or 512M (got {text!r})")
    unit = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    base = 1000 if m.group(3).upper() == "B" else 1024
    return int(float(m.group(1)) * base ** unit)


def free_memory(device: str) -> int:
    """Bytes free on ``device``: for the CPU ``MemAvailable`` (capped by a cgroup memory limit), for
    CUDA what ``torch.cuda.mem_get_info`` reports."""
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0])
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail if avail is not None else 1 << 62, int(limit) - used)
    except (OSError, ValueError):
        pass
    if avail is None:
        raise InputError("cannot tell this machine's free memory; pass --device MEM (e.g. --device 8GiB)")
    return avail


@dataclass
class Estimate:
    """Bytes of a setup on one device (see the module docstring)."""

    device: str
    ctx: int
    slots: int
    target: int
    draft: int
    kv_per_slot: int
    draft_kv_per_slot: int
    buffers: int
    runtime: int
    free: int | None = None
    max_ctx: int | None = None
    parts: dict = field(default_factory=dict)

    @property
    def kv(self) -> int:
        return self.slots * (self.kv_per_slot + self.draft_kv_per_slot)

    @property
    def total(self) -> int:
        return self.target + self.draft + self.kv + self.buffers + self.runtime

    @property
    def fits(self) -> bool:
        return self.free is None or self.total <= self.free

    def line(self) -> str:
        """One line: the parts, the total against the free memory, the largest context."""
        slot = "slot" if self.slots == 1 else "slots"
        s = (f"memory ({self.device}): target {fmt_bytes(self.target)} + drafter {fmt_bytes(self.draft)} + KV "
             f"{fmt_bytes(self.kv)} ({self.slots} {slot} x {fmt_bytes(self.kv_per_slot + self.draft_kv_per_slot)} at "
             f"-c {self.ctx}) + buffers {fmt_bytes(self.buffers)} + runtime {fmt_bytes(self.runtime)} = "
             f"{fmt_bytes(self.total)}")
        if self.free is not None:
            s += f" of {fmt_bytes(self.free)} free"
            s += f"; largest -c that fits: {self.max_ctx}" if self.max_ctx else "; no context fits"
        return s

    def table(self) -> str:
        """Several lines, for ``gemmaspec fit``."""
        rows = [("target weights", self.target), ("drafter weights", self.draft),
                (f"KV cache ({self.slots} x {fmt_bytes(self.kv_per_slot + self.draft_kv_per_slot)} per slot, "
                 f"-c {self.ctx})", self.kv), ("working buffers", self.buffers),
                ("runtime" + (" (process + tokenizer)" if self.device == "cpu" else " (CUDA context)"), self.runtime),
                ("total", self.total)]
        out = [f"{name:<48} {fmt_bytes(n):>12}" for name, n in rows]
        if self.free is not None:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            out.append(f"{'free on ' + self.device:<48} {fmt_bytes(self.free):>12}  -> {verdict}")
            out.append(f"largest -c that fits: {self.max_ctx}" if self.max_ctx else
                       "no context fits: the weights and runtime alone exceed the free memory")
        return "\n".join(out)


def estimate(target: ModelInfo, draft: ModelInfo | None = None, ctx: int | None = None, slots: int = 1,
             device: str = "cpu", free: int | None = None) -> Estimate:
    """The memory of ``target`` (+ ``draft``) with ``slots`` sequences of ``ctx`` positions.

    Args:
        ctx: context (None: min(4096, the model's), 0: the model's, as ``-c``).
        device: "cpu" or "cuda" (what the weights and runtime are counted for).
        free: the device's free bytes; with it the largest context that fits is found.

    Raises:
        InputError: ``ctx`` beyond the model's context, ``slots`` < 1.
    """
    model_ctx = target.context_length
    if ctx is None:
        ctx = min(4096, model_ctx)
    elif ctx == 0:
        ctx = model_ctx
    if ctx > model_ctx:
        raise InputError(f"-c {ctx} exceeds the model's context of {model_ctx} tokens")
    if slots < 1:
        raise InputError(f"-np must be at least 1 (got {slots})")

    def at(c: int) -> Estimate:
        vocabs = [target.text.vocab_size]
        if draft is not None and draft.role == "target":
            vocabs.append(draft.text.vocab_size)  # a draft model loads its tokenizer too
        runtime = runtime_bytes(device, *vocabs)
        bufs = max(buffer_bytes(target, c), buffer_bytes(draft, c) if draft is not None else 0)
        return Estimate(device, c, slots, weight_bytes(target, device),
                        weight_bytes(draft, device) if draft is not None else 0, kv_bytes_per_slot(target, c),
                        kv_bytes_per_slot(draft, c) if draft is not None else 0, bufs, runtime, free)

    est = at(ctx)
    if free is not None:
        lo, hi = 1, model_ctx  # the largest c with at(c).total <= free (total grows with c)
        if at(2).total > free:
            lo = 0
        else:
            lo = 2
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if at(mid).total <= free:
                    lo = mid
                else:
                    hi = mid - 1
        est.max_ctx = lo or None
    return est


def check_fits(est: Estimate) -> None:
    """Raise when the estimate exceeds the free memory.

    Raises:
        InputError: with the numbers, and the largest context that would fit (if any).
    """
    if est.fits:
        return
    hint = (f"use -c {est.max_ctx} or less" + (", fewer slots (-np)" if est.slots > 1 else "")
            if est.max_ctx else "use a smaller or more compressed model (e.g. a Q4_0 GGUF), or a bigger device")
    raise InputError(f"this setup does not fit: it needs {fmt_bytes(est.total)} and {est.device} has "
                     f"{fmt_bytes(est.free)} free (target {fmt_bytes(est.target)}, drafter {fmt_bytes(est.draft)}, "
                     f"KV {fmt_bytes(est.kv)}, buffers {fmt_bytes(est.buffers)}, runtime {fmt_bytes(est.runtime)}); "
                     f"{hint}")


def device_and_free(device: str) -> tuple[str, int]:
    """``--device`` (cpu, cuda, auto or a size) → (device counted for, free bytes). A size counts the
    CPU layout unless CUDA is available (then CUDA's)."""
    if device in ("cpu", "cuda"):
        return device, free_memory(device)
    if device == "auto" or re.fullmatch(r"\s*\d.*", device or ""):
        kind = "cpu"
        if device != "cpu":
            try:
                import torch

                kind = "cuda" if torch.cuda.is_available() else "cpu"
            except ImportError:
                pass
        return kind, (free_memory(kind) if device == "auto" else parse_mem(device))
    return "cpu", parse_mem(device)  # raises with the usage hint


def check_memory(model, draft_file, ctx_size: int | None, device: str = "auto", slots: int = 1,
                 caches: int | None = None) -> Estimate | None:
    """The estimate for the target ``model`` (None: the default model) with ``draft_file`` (the
    drafter's file from :func:`gemmaspec.speculative.plan.plan`, or None) at ``ctx_size`` per slot on
    ``device``, refused when it does not fit; returned for printing once the model is loaded. None
    where no estimate is made before loading: ``--device cuda`` without CUDA, or an assistant given
    as the target (loading says why, in its own words).

    Args:
        caches: KV caches allocated (default ``slots``; serve on CUDA adds the engine's own).

    Raises:
        InputError: the setup does not fit (with the numbers), or a bad ``-c``.
        ModelFileError: an unreadable model file (as loading would say).
    """
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None
    target = read_model(model)
    if target.role != "target":
        return None
    draft = read_model(draft_file) if draft_file else None
    est = estimate(target, draft, ctx_size, caches or slots, device, free_memory(device))
    check_fits(est)
    return est
