"""``gemmaspec verify``: check a file written by ``quantize --exact`` against its source, tensor by tensor.

Bounds: Q4_0 tensors within ``tolerance_ulp`` units in the source's last place for every value (the
exact packer's guarantee); Q8_0/F16/BF16/F32 tensors byte-identical to ``gguf.quants``' encoding of
the source (what the fallback writes); copied tensors byte-identical; every tensor of the source
present with its shape, and nothing extra. (Not to be confused with speculative decoding's
verification of drafted tokens, :mod:`gemmaspec.speculative`.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from ..loading.gguf import open_reader
from ..loading.gguf_out import encode_rows
from ..loading.stored import FLOAT_MANTISSA, StoredTensor, gguf_index
from .q4_0_exact import ulp
from .source import COPY_BYTES, open_source, row_spans

WRITTEN_FROM_FLOAT = (T.Q4_0, T.Q8_0, T.F16, T.BF16, T.F32)  # what quantize --exact makes of a float tensor


@dataclass
class CheckResult:
    """Outcome of :func:`check_against_source`: ``failures`` empty means every tensor is within its bound.

    Attributes:
        checked: tensors compared; by_type: how many of each GGML type name.
        worst_ulp_q4_0: the largest error of a Q4_0 value, in units of the source's last place.
        failures: one line per problem, naming the tensor.
    """

    checked: int = 0
    by_type: dict[str, int] = field(default_factory=dict)
    worst_ulp_q4_0: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def check_against_source(out: str | os.PathLike, against: str | os.PathLike, tolerance_ulp: float = 1.0) -> CheckResult:
    """Re-read ``out``, dequantize every tensor and check it against the source ``against`` (the
    bounds are in the module docstring).

    Raises:
        ModelFileError: either file is missing, corrupt or truncated.
    """
    src = open_source(against)
    out = Path(out)
    written = gguf_index(out, open_reader(out))
    res = CheckResult()
    for name, s in src.tensors:
        got = written.pop(name, None)
        if got is None:
            res.failures.append(f"{name}: in the source but not in {out.name}")
            continue
        if got.shape != tuple(s.shape):
            res.failures.append(f"{name}: shape {got.shape} in {out.name}, {tuple(s.shape)} in the source")
            continue
        res.checked += 1
        res.by_type[got.dtype] = res.by_type.get(got.dtype, 0) + 1
        if not isinstance(s, StoredTensor):  # computed (rope_freqs): F32
            same = np.array_equal(np.frombuffer(got.read_bytes(0, got.nbytes), np.float32), s.astype(np.float32).ravel())
            problem = None if same else "differs from the computed tensor"
        elif not s.is_float:
            problem = None if _same_integers(s, got) else "data differs from the source"
        else:
            problem = _check_float(s, got, tolerance_ulp, res)
        if problem:
            res.failures.append(f"{name}: {problem}")
    for name in written:
        res.failures.append(f"{name}: in {out.name} but not in the source")
    return res


def _same_integers(s: StoredTensor, got: StoredTensor) -> bool:
    """A copied tensor (quantized or integer GGUF data), or an integer safetensors tensor stored as I32."""
    if got.dtype == "I32" and s.dtype != "I32":
        return np.array_equal(s.load().numpy().astype(np.int32),
                              np.frombuffer(got.read_bytes(0, got.nbytes), np.int32).reshape(got.shape))
    return s.nbytes == got.nbytes and all(
        s.read_bytes(a, min(COPY_BYTES, s.nbytes - a)) == got.read_bytes(a, min(COPY_BYTES, s.nbytes - a))
        for a in range(0, s.nbytes, COPY_BYTES))


def _check_float(s: StoredTensor, got: StoredTensor, tolerance_ulp: float, res: CheckResult) -> str | None:
    """The problem with ``got``, a float source tensor ``s`` as written, or None; Q4_0's worst error goes to ``res``."""
    qtype = T[got.dtype]
    if qtype not in WRITTEN_FROM_FLOAT:
        return f"stored as {got.dtype}, which quantize --exact never writes for a {s.dtype} tensor"
    block, bsize = gguf.GGML_QUANT_SIZES[qtype]
    row_bytes = s.row_len // block * bsize
    mbits = FLOAT_MANTISSA[s.dtype]
    for r0, r1 in row_spans(s):
        want = s.read_rows(r0, r1)
        raw = np.frombuffer(got.read_bytes(r0 * row_bytes, (r1 - r0) * row_bytes), np.uint8).reshape(r1 - r0, row_bytes)
        if qtype == T.Q4_0:
            errs = np.abs(gguf.quants.dequantize(raw, qtype).astype(np.float64) - want) / ulp(want, mbits)
            worst = float(errs.max())
            res.worst_ulp_q4_0 = max(res.worst_ulp_q4_0, worst)
            if worst > tolerance_ulp:
                r, c = np.unravel_index(int(errs.argmax()), errs.shape)
                return f"row {r0 + r} column {c} is {worst:.2f} ulp off the source (bound {tolerance_ulp})"
        elif not np.array_equal(np.ascontiguousarray(encode_rows(want, qtype)).view(np.uint8).reshape(r1 - r0, -1), raw):
            return f"{got.dtype} data is not the source's {got.dtype} encoding (rows {r0}..{r1 - 1})"
    return None
