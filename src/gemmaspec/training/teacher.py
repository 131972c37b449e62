"""Teacher signals for drafter training: what the target itself computes over a text.

For each chunk of ``L`` tokens, one target forward (a fresh KV cache) gives, per position i:
the final-norm hidden state (what the assistant's first step reads), the K/V of the target layers the
assistant attends over (:meth:`kv_layout`: the last layer of each attention type), and the target's
top-k next-token log-probabilities (its distribution for token i+1, renormalised over the whole
vocabulary before the top-k is taken). Chunks are saved one file each (``chunk-000123.pt``, written
atomically) in a directory keyed by the target file's identity and the corpus, so a second run, or
one resumed after a crash, skips every chunk already there.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.base import linear

TOP_K = 8


@dataclass
class Chunk:
    """One chunk's teacher signals (float16 storage, float32 when used).

    Attributes:
        tokens: int64 [L], the text's token ids.
        hidden: float16 [L, Hb], the target's final-norm hidden state at each position.
        kv: per layer type (``sliding``/``full``): (keys float16 [L, Hkv, D], values float16 [L, Hkv, D]),
            after the target's k-norm and RoPE, as its cache holds them.
        top_ids: int32 [L, TOP_K], the target's most likely next tokens at each position (position i
            predicts token i+1), best first.
        top_logp: float16 [L, TOP_K], their log-probabilities (over the whole vocabulary).
    """

    tokens: torch.Tensor
    hidden: torch.Tensor
    kv: dict
    top_ids: torch.Tensor
    top_logp: torch.Tensor

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"tokens": self.tokens, "hidden": self.hidden, "kv": self.kv, "top_ids": self.top_ids,
                    "top_logp": self.top_logp}, tmp)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "Chunk":
        d = torch.load(path, weights_only=True)
        return cls(d["tokens"], d["hidden"], d["kv"], d["top_ids"], d["top_logp"])


@torch.inference_mode()
def teacher_chunk(model, tokens: list[int], rows: int = 256) -> Chunk:
    """Run the target over ``tokens`` (one chunk, fresh cache) and collect its signals.

    Args:
        model: a built target (Gemma 3 or Gemma 4) with ``kv_layout``, ``new_cache``, ``head``.
        tokens: the chunk's token ids (at most the model's context).
        rows: hidden rows pushed through the head at a time for the top-k (each push dequantizes
            the whole head tile by tile, so fewer, larger pushes are faster; 256 rows of logits
            over a 262,144-token vocabulary are 268 MB).
    """
    t = torch.tensor(tokens, dtype=torch.int64)
    cache = model.new_cache(len(tokens) + 1, ring=False)  # rows = positions in every layer
    out = model.forward(t, cache)
    hidden = out.hidden
    kv = {}
    for kind, (layer, _, _) in model.kv_layout().items():
        lk = cache.layers[layer]
        kv[kind] = (lk.k[:len(tokens)].to(torch.float16).clone(), lk.v[:len(tokens)].to(torch.float16).clone())
    cap = getattr(model.config, "final_logit_softcapping", None)
    ids, logps = [], []
    for i in range(0, hidden.shape[0], rows):
        logits = linear(model.head, hidden[i:i + rows])
        if cap:
            logits = torch.tanh(logits / cap) * cap
        lp = torch.log_softmax(logits, dim=-1)
        v, ix = torch.topk(lp, TOP_K, dim=-1)
        ids.append(ix.to(torch.int32))
        logps.append(v.to(torch.float16))
    return Chunk(t, hidden.to(torch.float16), kv, torch.cat(ids), torch.cat(logps))


def chunk_dir(root: Path, target_path: Path, corpus_key: str) -> Path:
    """``root/<target id>/<corpus key>``: the target's identity is its file name, size and the sha256 of
    its first and last MiB (hashing 250 MB on every run would cost seconds)."""
    p = Path(target_path)
    h = hashlib.sha256(f"{p.name}|{p.stat().st_size}".encode())
    with open(p, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, p.stat().st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return Path(root) / h.hexdigest()[:16] / corpus_key


def build_chunks(model, sequences: list[list[int]], out_dir: Path, length: int = 256, min_len: int = 32,
                 progress=None) -> list[Path]:
    """Split each token sequence into chunks of ``length`` (a shorter tail of at least ``min_len`` is
    kept) and write the teacher signals of every chunk not yet in ``out_dir``.

    Returns:
        The chunk files, in corpus order.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pieces = []
    for seq in sequences:
        for i in range(0, len(seq), length):
            piece = seq[i:i + length]
            if len(piece) >= min_len:
                pieces.append(piece)
    paths = []
    for j, piece in enumerate(pieces):
        path = out_dir / f"chunk-{j:06d}.pt"
        if not path.exists():
            teacher_chunk(model, piece).save(path)
        paths.append(path)
        if progress is not None:
            progress(j + 1, len(pieces))
    return paths
