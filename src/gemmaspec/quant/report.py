"""The evidence of ``gemmaspec quantize --exact``: per-tensor and total error figures, sizes, the table.

Per tensor and in total: blocks on the grid, values reproduced bit-exactly (after d·level is rounded
to the source's type, and in float32 itself), the worst error in units of the source's last place
(ulp), the relative Frobenius error against the source, and the same errors for what llama.cpp's Q8_0
and a plain amax/8 Q4_0 would give (with how many times closer to the source exact Q4_0 is than Q8_0),
plus the file sizes of exact Q4_0, Q8_0 and the source. :func:`gemmaspec.quant.quantize.quantize_exact` fills it in.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from .q4_0_exact import Q4_0_BYTES, ulp

Q8_0_BYTES = GGML_QUANT_SIZES[T.Q8_0][1]


@dataclass
class ErrorFigures:
    """Reconstruction error of one encoding against the source."""

    sq_err: float = 0.0  # sum of squared errors
    sq_src: float = 0.0  # sum of squared source values
    max_err_ulp: float = 0.0  # worst error, in units of the source's last place

    @property
    def rel_err(self) -> float:
        """Relative Frobenius error ||W' - W|| / ||W||."""
        return math.sqrt(self.sq_err / self.sq_src) if self.sq_src > 0 else 0.0

    def add(self, other: "ErrorFigures") -> None:
        self.sq_err += other.sq_err
        self.sq_src += other.sq_src
        self.max_err_ulp = max(self.max_err_ulp, other.max_err_ulp)

    def to_json(self) -> dict:
        return {"rel_err": self.rel_err, "max_err_ulp": self.max_err_ulp}

    def closer_than(self, other: "ErrorFigures") -> float | None:
        """How many times smaller this relative error is than ``other``'s (``other.rel_err / rel_err``);
        None when this one is 0 (nothing to divide by)."""
        return other.rel_err / self.rel_err if self.rel_err > 0 else None

    @classmethod
    def measure(cls, rows: np.ndarray, approx: np.ndarray, mantissa_bits: int) -> "ErrorFigures":
        """The error of ``approx`` (any float array of ``rows``' size) against the source ``rows``
        (float32 [R, K], from a format with ``mantissa_bits`` explicit mantissa bits)."""
        src = rows.astype(np.float64)
        err = approx.astype(np.float64).reshape(src.shape) - src
        return cls(float((err ** 2).sum()), float((src ** 2).sum()), float((np.abs(err) / ulp(rows, mantissa_bits)).max()))


@dataclass
class TensorReport:
    """What happened to one tensor."""

    name: str
    shape: list[int]
    source_type: str
    type: str  # what was written
    bytes: int = 0
    blocks: int = 0
    blocks_on_grid: int = 0
    values: int = 0
    values_exact: int = 0  # d·level (float32) equal to the source value
    values_exact_src: int = 0  # d·level rounded to the source type equal to it (what the search maximizes)
    exact: ErrorFigures = field(default_factory=ErrorFigures)
    q8_0: ErrorFigures = field(default_factory=ErrorFigures)
    q4_0_amax: ErrorFigures = field(default_factory=ErrorFigures)
    stored: ErrorFigures = field(default_factory=ErrorFigures)  # a fallback tensor as written (sampled rows)
    compared_fraction: float = 0.0
    note: str = ""

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("exact", "q8_0", "q4_0_amax", "stored")}
        if self.blocks:
            d.update(best_grid_fit=self.exact.to_json(), q8_0=self.q8_0.to_json(), q4_0_amax=self.q4_0_amax.to_json())
            d["as_stored"] = self.exact.to_json() if self.type == "Q4_0" else self.stored.to_json()
            q4 = self.type == "Q4_0"  # a fallback tensor is not stored as its grid fit
            d["bit_exact_fraction"] = self.values_exact_src / self.values if q4 else None
            d["closer_than_q8_0"] = (self.exact if q4 else self.stored).closer_than(self.q8_0)  # as stored
        return d


@dataclass
class QuantizeReport:
    """The evidence for one ``quantize --exact`` run (see :mod:`gemmaspec.quant.quantize`)."""

    source: str
    output: str
    fallback: str
    tolerance_ulp: float
    tensors: list[TensorReport] = field(default_factory=list)
    source_bytes: int = 0
    output_bytes: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def totals(self) -> dict:
        """Totals. Error figures compare like with like: exact Q4_0, Q8_0 and amax/8 Q4_0 over the
        tensors written as exact Q4_0; ``whole_file_rel_err`` over every weight the packer looked at,
        as stored (fallback tensors at their fallback type's error, measured like Q8_0's)."""
        looked = [t for t in self.tensors if t.blocks]
        packed = [t for t in looked if t.type == "Q4_0"]
        ex, q8, q4, whole = ErrorFigures(), ErrorFigures(), ErrorFigures(), ErrorFigures()
        for t in packed:
            ex.add(t.exact)
            q8.add(t.q8_0)
            q4.add(t.q4_0_amax)
            whole.add(t.exact)
        for t in looked:
            if t.type != "Q4_0":
                whole.add(t.stored)
        q4_blocks, q4_values = sum(t.blocks for t in packed), sum(t.values for t in packed)
        return {
            "tensors": len(self.tensors),
            "tensors_q4_0": len(packed),
            "tensors_fallback": len(looked) - len(packed),
            "blocks": sum(t.blocks for t in looked),
            "blocks_on_grid": sum(t.blocks_on_grid for t in looked),
            "values": sum(t.values for t in looked),
            "values_exact": sum(t.values_exact for t in looked),
            "values_exact_src": sum(t.values_exact_src for t in looked),
            # over the tensors written as exact Q4_0: values given back after rounding to the source type, in float32
            "bit_exact_fraction_q4_0": sum(t.values_exact_src for t in packed) / q4_values if q4_values else None,
            "bit_exact_fraction_q4_0_f32": sum(t.values_exact for t in packed) / q4_values if q4_values else None,
            "exact_q4_0": ex.to_json(),
            "q8_0": q8.to_json(),
            "q4_0_amax": q4.to_json(),
            "closer_than_q8_0": ex.closer_than(q8),
            "whole_file_rel_err": whole.rel_err,
            # the same file with every exact-Q4_0 tensor in Q8_0 instead (34 instead of 18 bytes per block)
            "bytes": {"exact_q4_0": self.output_bytes, "q8_0": self.output_bytes + q4_blocks * (Q8_0_BYTES - Q4_0_BYTES),
                      "source": self.source_bytes},
        }

    def to_json(self) -> dict:
        return {"source": self.source, "output": self.output, "fallback": self.fallback,
                "tolerance_ulp": self.tolerance_ulp, "seconds": self.seconds,
                "throughput_mb_s": self.source_bytes / 1e6 / self.seconds if self.seconds else None,
                "notes": self.notes, "total": self.totals(), "tensors": [t.to_json() for t in self.tensors]}

    def table(self, per_tensor: bool = True) -> str:
        """The report as text for the terminal."""
        lines = []
        if per_tensor:
            lines.append(f"{'tensor':<44} {'type':<5} {'on grid':>15} {'bit-exact':>9} {'max ulp':>7} "
                         f"{'rel err':>9} {'Q8_0':>9} {'vs Q8_0':>8} {'amax Q4_0':>9}")
            lines.extend(_tensor_line(t) for t in self.tensors)
        s = self.totals()
        b = s["bytes"]
        if not s["blocks"]:
            lines.append("total: no BF16/F16/F32 weight to pack (every tensor was copied or kept as it was); "
                         "the input is not an unquantized checkpoint")
        else:
            exact = (f"; the Q4_0 tensors give back {s['bit_exact_fraction_q4_0']:.1%} of their values bit-exactly in the "
                     f"source's type ({s['bit_exact_fraction_q4_0_f32']:.1%} in float32), worst "
                     f"{s['exact_q4_0']['max_err_ulp']:.2f} ulp") if s["tensors_q4_0"] else ""
            lines.append(
                f"total: {s['tensors_q4_0']} tensors exact Q4_0, {s['tensors_fallback']} in the fallback ({self.fallback}); "
                f"{s['blocks_on_grid']}/{s['blocks']} blocks on the grid{exact}")
        if s["tensors_q4_0"]:
            ex, q8, q4 = s["exact_q4_0"]["rel_err"], s["q8_0"]["rel_err"], s["q4_0_amax"]["rel_err"]
            ratio = f" ({q8 / ex:.1f}x closer than Q8_0)" if ex > 0 else (" (Q8_0 is not)" if q8 > 0 else "")
            lines.append(f"relative error vs source over the exact-Q4_0 tensors: exact Q4_0 {ex:.2e}{ratio}, "
                         f"Q8_0 {q8:.2e}, amax/8 Q4_0 {q4:.2e}; whole file as written {s['whole_file_rel_err']:.2e}")
        lines.append(f"size: exact Q4_0 {format_size(b['exact_q4_0'])}, Q8_0 {format_size(b['q8_0'])} "
                     f"({1 - b['exact_q4_0'] / b['q8_0']:.0%} smaller), source {format_size(b['source'])}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _tensor_line(t: TensorReport) -> str:
    """One row of the per-tensor table: bit-exact is the share of values that d·level, rounded to the
    source's type, gives back; vs Q8_0 how many times closer to the source than Q8_0 the tensor is."""
    if not t.blocks:
        return f"{t.name[:44]:<44} {t.type:<5} {'(' + (t.note or 'kept') + ')':>15}"
    head = f"{t.name[:44]:<44} {t.type:<5} {t.blocks_on_grid:>7}/{t.blocks:<7} "
    if t.type != "Q4_0":  # fallback: the error of what was stored, not of the rejected grid fit
        return (head + f"{'-':>9} {t.stored.max_err_ulp:>7.2f} {t.stored.rel_err:>9.2e} {t.q8_0.rel_err:>9.2e} "
                f"{'-':>8} {t.q4_0_amax.rel_err:>9.2e}  (fallback: not on a grid)")
    ratio = t.exact.closer_than(t.q8_0)
    closer = "exact" if ratio is None else f"{ratio:.1f}x"
    return (head + f"{t.values_exact_src / t.values:>9.1%} {t.exact.max_err_ulp:>7.2f} {t.exact.rel_err:>9.2e} "
            f"{t.q8_0.rel_err:>9.2e} {closer:>8} {t.q4_0_amax.rel_err:>9.2e}")


def format_size(n: int) -> str:
    """``n`` bytes for people: MB (10^6) with enough digits for small files, e.g. ``"12.3 MB"``."""
    return f"{n / 1e6:.1f} MB" if n >= 10e6 else f"{n / 1e6:.3f} MB" if n >= 10e3 else f"{n} bytes"


def write_report(rep: QuantizeReport, path: str | os.PathLike) -> None:
    """The report as JSON at ``path``."""
    Path(path).write_text(json.dumps(rep.to_json(), indent=1))
