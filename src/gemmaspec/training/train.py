"""Distil an MTP assistant from a target: ``gemmaspec train-drafter``.

Data: teacher chunks (:mod:`.teacher`) of a corpus (:mod:`.corpus`). For every position p of a
chunk (1 <= p < L - K), a round of K draft steps is unrolled as it runs at inference
(:class:`~gemmaspec.speculative.drafters.MTPDrafter`): step 1 reads the target's embedding of token p
and its hidden state at p - 1, every step attends over the target's K/V at positions < p (sliding
layers: within the window) at position p, and step k+1 reads the embedding of token p + k and step k's
``post_projection`` output. The loss of step k is the cross-entropy against the target's top-k
distribution at position p + k - 1 (its prediction of token p + k), restricted to the draft vocabulary
and renormalised (KL to the target up to a constant), averaged over positions and steps.

Optimiser: AdamW, linear warm-up then cosine decay to 10%, gradient-norm clipping at 1.0. One
optimiser step per chunk; chunk order is a seeded permutation per epoch, so a run is a pure function
of its settings and step: ``--resume`` from a checkpoint continues with the same losses the
uninterrupted run would have had. A checkpoint (``ckpt.pt``, written atomically) is kept every
``ckpt_every`` steps and on Ctrl-C.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..loading.assistant_gguf import new_trainable_assistant
from .teacher import Chunk


@dataclass
class TrainSettings:
    """A training run's settings (saved in its checkpoints; a resumed run uses the saved ones)."""

    width: int = 256
    layers: int = 4
    heads: int = 4
    ffn: int = 1024
    draft_vocab: int = 8192
    steps: int = 2000
    draft_steps: int = 3
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    seed: int = 0
    qat: str | None = None  # "q4_0": fake-quantize every matrix on the Q4_0 grid (straight-through)
    ckpt_every: int = 100
    eval_every: int = 100
    held_out: float = 0.05  # fraction of chunks kept out of training for the acceptance estimate


def choose_draft_vocab(chunks: list[Chunk], n: int, vocab_size: int) -> torch.Tensor:
    """The ``n`` target tokens the draft head covers: the most frequent greedy predictions of the
    target over the training chunks (what it will be asked to draft), then the most frequent text
    tokens, ties by id. Returns int64 [n], sorted by id."""
    pred = torch.zeros(vocab_size, dtype=torch.float64)
    text = torch.zeros(vocab_size, dtype=torch.float64)
    for c in chunks:
        pred += torch.bincount(c.top_ids[:, 0].long(), minlength=vocab_size).double()
        text += torch.bincount(c.tokens, minlength=vocab_size).double()
    score = pred * 1e6 + text  # predictions first
    n = min(n, vocab_size)
    top = torch.topk(score, n).indices
    return torch.sort(top).values


def lr_at(s: TrainSettings, step: int) -> float:
    """Learning rate of optimiser step ``step`` (0-based): warm-up, then cosine to 10% of ``lr``."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    prog = min(1.0, (step - s.warmup) / max(1, s.steps - s.warmup))
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))


class Batch:
    """One chunk prepared for the unrolled draft steps (float32 tensors; see the module docstring)."""

    def __init__(self, chunk: Chunk, embed, k: int, window: int, to_draft: torch.Tensor):
        L = chunk.tokens.shape[0]
        self.p = torch.arange(1, L - k)  # positions with k labels inside the chunk
        self.emb = embed(chunk.tokens).float()  # [L, Hb], scaled as the target embeds
        self.hidden = chunk.hidden.float()
        self.tokens = chunk.tokens
        keys = torch.arange(L)
        visible = keys[None, :] < self.p[:, None]
        self.kv = {kind: (kk.float(), vv.float(),
                          visible & (keys[None, :] > self.p[:, None] - window) if kind == "sliding" else visible)
                   for kind, (kk, vv) in chunk.kv.items()}
        # soft labels per step: target distribution at p + j - 1, restricted to the draft vocabulary
        self.labels = []
        for j in range(1, k + 1):
            at = self.p + j - 1
            ids, lp = chunk.top_ids[at].long(), chunk.top_logp[at].float()
            d = to_draft[ids]  # -1 outside the draft vocabulary
            prob = torch.where(d >= 0, lp.exp(), torch.zeros_like(lp))
            mass = prob.sum(-1, keepdim=True)
            self.labels.append((d.clamp(min=0), prob / mass.clamp(min=1e-12), mass[:, 0] > 0,
                                to_draft[ids[:, 0]]))

    def run(self, model, k: int):
        """Per step: (logits [P, N], soft-label ids [P, TOP_K], weights, valid, greedy draft id)."""
        x = self.emb[self.p]
        h = self.hidden[self.p - 1]
        out = []
        for j in range(k):
            logits, h = model.step(x, h, self.p, self.kv)
            out.append((logits,) + self.labels[j])
            x = self.emb[self.p + j + 1] if j + 1 < k else None
        return out


def loss_of(outs) -> torch.Tensor:
    total = 0.0
    for logits, ids, w, valid, _ in outs:
        logp = torch.log_softmax(logits, dim=-1).gather(1, ids)
        ce = -(w * logp).sum(-1)
        total = total + (ce * valid).sum() / valid.sum().clamp(min=1)
    return total / len(outs)


@torch.no_grad()
def evaluate(model, batches: list[Batch], k: int) -> dict:
    """Teacher-forced draft quality on held-out chunks: per step the fraction of positions whose
    draft (the head's argmax) equals the target's greedy token, and the mean accepted length of a
    round of k drafts (1 + the number of leading steps all right; the bonus token included)."""
    right = torch.zeros(k)
    run_len, n = 0.0, 0
    for b in batches:
        outs = b.run(model, k)
        ok = []
        for j, (logits, _, _, _, greedy) in enumerate(outs):
            hit = (logits.argmax(-1) == greedy) & (greedy >= 0)
            right[j] += hit.float().sum()
            ok.append(hit)
        chain = torch.ones_like(ok[0])
        acc = torch.zeros(ok[0].shape[0])
        for hit in ok:
            chain = chain & hit
            acc += chain.float()
        run_len += float(acc.sum())
        n += ok[0].shape[0]
    return {"per_step": [round(float(r) / max(1, n), 4) for r in right], "mean_accepted_length": 1 + run_len / max(1, n)}


def load_remapped(model, state: dict, old_map: torch.Tensor) -> dict:
    """Load another run's weights ``state`` (draft vocabulary ``old_map``) into ``model``, whose draft
    vocabulary may differ: every weight but the head is copied; head rows of tokens both vocabularies
    have are copied, the rest keep ``model``'s values. Returns ``{"rows_copied": n}``."""
    head = "params.token_embd__weight"
    own = model.state_dict()
    new = {k: v for k, v in state.items() if k not in (head, "token_map")}
    rows = own[head].clone()
    pos = torch.full((int(max(old_map.max(), model.token_map.max())) + 1,), -1, dtype=torch.int64)
    pos[old_map.long()] = torch.arange(old_map.numel())
    src = pos[model.token_map]
    hit = src >= 0
    rows[hit] = state[head][src[hit]]
    new[head] = rows
    new["token_map"] = model.token_map
    model.load_state_dict(new)
    return {"rows_copied": int(hit.sum())}


def load_init(path: Path) -> dict:
    """The weights a new run starts from (``--init``): another run's checkpoint (``ckpt.pt``) or an
    assistant GGUF this trainer wrote (a reduced-head ``gemma4-assistant``: ``draft_token_map`` present;
    Q4_0 / Q8_0 / F16 / F32 matrices are dequantized to float32). Returns ``{"model": state dict,
    "token_map": int64 [N], "settings": {"width", "layers", "heads", "ffn"}}``.

    Raises:
        ValueError: a GGUF that is not a reduced-head ``gemma4-assistant`` (e.g. Google's full or
            clustered head), or that misses one of the tensors the trainable assistant has.
    """
    path = Path(path)
    if path.suffix != ".gguf":
        start = torch.load(path, weights_only=False)
        return {"model": start["model"], "token_map": start["token_map"],
                "settings": {f: start["settings"][f] for f in ("width", "layers", "heads", "ffn")}}
    from ..loading.assistant_gguf import trainable_state_from_gguf

    return trainable_state_from_gguf(path)


def save_checkpoint(path: Path, model, opt, settings: TrainSettings, step: int, history: list) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "settings": dataclasses.asdict(settings),
                "step": step, "history": history, "config": model.config.to_json(),
                "token_map": model.token_map}, tmp)
    os.replace(tmp, path)


def train(target, chunk_paths: list[Path], out_dir: Path, settings: TrainSettings, resume: bool = False,
          progress: bool = True, log=print, stop_after: int | None = None,
          max_seconds: float | None = None, init: Path | None = None,
          held_paths: list[Path] | None = None) -> tuple:
    """Train (or continue) an assistant for ``target`` on the teacher chunks; checkpoints go to
    ``out_dir/ckpt.pt``. Returns the model and the history (one dict per step).

    ``stop_after`` steps or ``max_seconds`` of wall time end this call early with a checkpoint (the
    schedule stays that of ``settings.steps``; ``resume=True`` continues where it stopped).

    ``held_paths``: the held-out chunks (default: the last ``settings.held_out`` fraction of
    ``chunk_paths``), kept out of training for the acceptance estimate.

    ``init``: a checkpoint of another run, or an assistant GGUF this trainer wrote (:func:`load_init`),
    to start from (a new run only): its architecture (width,
    layers, heads, FFN) and weights are taken, the optimiser and schedule start afresh. The draft
    vocabulary is chosen from this run's data (``settings.draft_vocab`` rows); head rows of tokens the
    checkpoint's vocabulary also has are copied from it, the others start as in a new run.

    Raises:
        ValueError: no chunks, a resumed checkpoint for another draft vocabulary, or an ``init`` GGUF
            that is not a reduced-head assistant (:func:`load_init`).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / "ckpt.pt"
    chunks = [Chunk.load(p) for p in chunk_paths]
    if not chunks:
        raise ValueError("no training chunks")
    ckpt = torch.load(ckpt_path, weights_only=False) if resume and ckpt_path.exists() else None
    if ckpt is not None:
        saved = TrainSettings(**ckpt["settings"])
        # a resumed run keeps its settings, except a QAT stage and a longer schedule asked for now
        # (fine-tuning a float run on the Q4_0 grid: --resume --qat q4_0 --steps MORE)
        settings = dataclasses.replace(saved, qat=settings.qat or saved.qat, steps=max(saved.steps, settings.steps))
    start = None
    if ckpt is None and init is not None:
        start = load_init(init)
        settings = dataclasses.replace(settings, **start["settings"])
    if held_paths is not None:
        train_chunks, held = chunks, [Chunk.load(p) for p in held_paths]
    else:
        n_held = max(1, int(len(chunks) * settings.held_out)) if len(chunks) > 1 else 0
        train_chunks, held = chunks[:len(chunks) - n_held], chunks[len(chunks) - n_held:]
    vocab = target.config.vocab_size
    token_map = ckpt["token_map"] if ckpt is not None else choose_draft_vocab(train_chunks, settings.draft_vocab, vocab)
    model = new_trainable_assistant(target.config, token_map, settings.width, settings.layers, settings.heads,
                                    settings.ffn, settings.seed)
    if settings.qat == "q4_0":
        from .qat import fake_quant_q4_0

        model.quant = fake_quant_q4_0
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    step, history = 0, []
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        step, history = ckpt["step"], ckpt["history"]
    elif start is not None:
        load_remapped(model, start["model"], start["token_map"])
    to_draft = torch.full((vocab,), -1, dtype=torch.int64)
    to_draft[token_map] = torch.arange(token_map.numel())
    if held and ckpt is None:
        greedy = torch.cat([c.top_ids[:, 0].long() for c in held])
        log(f"draft vocabulary: {token_map.numel()} tokens; they are the target's greedy next token at "
            f"{float((to_draft[greedy] >= 0).float().mean()):.1%} of held-out positions")
    embed = target.embed_tokens
    window = target.config.sliding_window
    k = settings.draft_steps
    held_batches = [Batch(c, embed, k, window, to_draft) for c in held]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=settings.steps, initial=step, desc="train-drafter", unit="step")
    started, first = time.perf_counter(), step
    try:
        while step < settings.steps:
            if (stop_after is not None and step - first >= stop_after) or \
                    (max_seconds is not None and time.perf_counter() - started > max_seconds):
                save_checkpoint(ckpt_path, model, opt, settings, step, history)
                log(f"stopped at step {step} of {settings.steps}: checkpoint saved in {ckpt_path}; --resume continues")
                break
            epoch, idx = divmod(step, len(train_chunks))
            order = torch.randperm(len(train_chunks), generator=torch.Generator().manual_seed(settings.seed * 1000 + epoch))
            batch = Batch(train_chunks[int(order[idx])], embed, k, window, to_draft)
            for group in opt.param_groups:
                group["lr"] = lr_at(settings, step)
            loss = loss_of(batch.run(model, k))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            rec = {"step": step, "loss": float(loss.detach()), "lr": lr_at(settings, step - 1)}
            if held_batches and (step % settings.eval_every == 0 or step == settings.steps):
                rec["held_out"] = evaluate(model, held_batches, k)
            history.append(rec)
            if bar is not None:
                post = {"loss": f"{float(loss):.3f}"}
                last = next((h["held_out"]["mean_accepted_length"] for h in reversed(history) if "held_out" in h), None)
                if last is not None:
                    post["held-out len"] = f"{last:.2f}"
                bar.set_postfix(post)
                bar.update(1)
            if step % settings.ckpt_every == 0 or step == settings.steps:
                save_checkpoint(ckpt_path, model, opt, settings, step, history)
    except KeyboardInterrupt:
        save_checkpoint(ckpt_path, model, opt, settings, step, history)
        log(f"interrupted at step {step}: checkpoint saved in {ckpt_path}; --resume continues")
        raise
    finally:
        if bar is not None:
            bar.close()
    (out_dir / "history.json").write_text(json.dumps(history))
    return model, history
