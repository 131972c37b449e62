"""``gemmaspec export llama-server|vllm|sglang``: the launch command of another server for the same
target, drafter and speculative settings, so a setup that outgrows one machine moves without
re-deriving flags (docs/scale-out.md).

- **llama-server** (llama.cpp) takes GGUF files: ``-m`` / ``-md``, ``--spec-type``,
  ``--spec-draft-n-max``, ``-c``, ``-np`` (the flags gemmaspec copies).
- **vLLM** serves Hugging Face checkpoints; a Gemma 4 assistant goes in ``--speculative-config`` with
  ``"method": "mtp"`` (vLLM's MTP docs), n-gram lookup as ``"method": "ngram"``, a separate draft
  model as ``"method": "draft_model"``. A catalog GGUF is exported as the checkpoint it was made from
  (``hf_equivalent``). ``--tensor-parallel-size`` is the smallest power of two whose share of the
  weights, KV cache and buffers (bf16, the checkpoint's own type) fits ``--gpu-mem`` at vLLM's default
  ``--gpu-memory-utilization`` 0.9 and divides the attention heads.
- **SGLang**: ``--speculative-algorithm NEXTN`` with the assistant as the draft model (SGLang's MTP
  path), ``NGRAM`` for lookup; ``--tp-size`` as for vLLM. Support for Gemma 4 assistants in SGLang is
  not verified here.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from ..errors import InputError
from ..manage.remote import is_stand_in
from ..speculative.options import spec_model_type
from .args import add_spec, read_target, resolve_models, spec_config

TARGETS = ("llama-server", "vllm", "sglang")
GPU_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization


def add_parser(sub) -> None:
    """Register ``export`` on the ``gemmaspec`` subparsers."""
    e = sub.add_parser("export", help="print the llama-server / vLLM / SGLang command for the same model and drafter",
                       allow_abbrev=False)
    e.add_argument("server", choices=TARGETS, help="the server to launch")
    e.add_argument("-m", "--model", default=None, help="model file, directory or known name (default: the embedded one)")
    e.add_argument("-c", "--ctx-size", type=int, default=None, help="context per sequence (default 4096 or the model's)")
    e.add_argument("-np", "--parallel", type=int, default=1, help="sequences served at once (default 1)")
    e.add_argument("--port", type=int, default=8080, help="port of the exported server (default 8080)")
    e.add_argument("--gpu-mem", default="80GiB", help="memory of one GPU, for the tensor-parallel size (default 80GiB)")
    add_spec(e)  # the speculation exported is what gemmaspec generate / serve would run


def _name_for_vllm(arg: str | None, path: str | None, entry) -> str:
    """What vLLM / SGLang should load: a catalog entry's Hugging Face repo (a GGUF entry's source
    checkpoint), else the local path."""
    from ..manage import catalog

    if entry is not None:
        if entry.hf_equivalent:
            entry = catalog.get(entry.hf_equivalent)
        if entry.repo and entry.is_dir:
            return entry.repo
    if path is None:
        raise InputError("vLLM and SGLang need a Hugging Face checkpoint; the embedded default model is a GGUF "
                         "(export llama-server, or pass -m with a checkpoint or a known Gemma 4 name)")
    if path.endswith(".gguf"):
        print(f"note: {path} is a GGUF; vLLM's GGUF support is limited and an MTP assistant must be a checkpoint "
              "directory: export the Hugging Face checkpoint it was made from instead", file=sys.stderr)
    return path


def tensor_parallel(total_bytes: int, gpu_bytes: int, heads: int) -> int:
    """Smallest power of two t (1..8) with total/t within GPU_UTILIZATION of one GPU and heads % t == 0.

    Raises:
        InputError: even 8 GPUs are not enough.
    """
    for t in (1, 2, 4, 8):
        if heads % t == 0 and total_bytes / t <= GPU_UTILIZATION * gpu_bytes:
            return t
    from ..kernels.memory import fmt_bytes

    raise InputError(f"the setup needs {fmt_bytes(total_bytes)}: more than 8 GPUs of --gpu-mem {fmt_bytes(gpu_bytes)}; "
                     "use pipeline parallelism across nodes (see docs/scale-out.md)")


def _gpu_estimate(target_path, draft_path, ctx, slots) -> tuple[int, int, int]:
    """(bytes the exported server needs in bf16, attention heads, context used)."""
    from ..manage.fit import buffer_bytes, kv_bytes_per_slot, read_model

    t = read_model(target_path)
    d = read_model(draft_path) if draft_path else None
    c = ctx or min(4096, t.context_length)
    params = sum(n for m in (t, d) if m is not None for n in _numels(m))
    total = 2 * params + slots * kv_bytes_per_slot(t, c, dtype_bytes=2) + buffer_bytes(t, c) // 2
    return total, t.text.num_heads, c


def _numels(m):
    import math

    return [math.prod(shape) if shape else 1 for _, _, shape, _ in m.tensors]


def build_command(args) -> list[str]:
    """The exported server's argv for ``args`` (models already resolved to paths): the drafter
    gemmaspec's :func:`~gemmaspec.speculative.plan.plan` picks (so no flags means gemmaspec's default
    speculation, the shipped assistant included), in the other server's terms.

    Raises:
        InputError: ``auto`` draft length, an ``-md`` of the wrong role, a list for vLLM / SGLang,
            a file the server cannot load.
    """
    from ..manage.fit import parse_mem, read_model
    from ..speculative.plan import plan

    notes: list[str] = []  # said on stderr once the command is known to be printed
    given = args.spec_type is not None or args.model_draft is not None
    target_info = read_target(args.model)  # a missing, unreadable or assistant file is refused as generate does
    if args.parallel < 1:
        raise InputError(f"-np must be at least 1 (got {args.parallel})")
    drafter_plan = plan(spec_config(args), args.model)
    n, spec = drafter_plan.spec.n_max, drafter_plan.spec_type
    if n == "auto":
        raise InputError("--spec-draft-n-max auto is gemmaspec's own; give the exported server a number")
    model_type = drafter_plan.model_type
    if model_type and args.model_draft:  # the role the type needs, as gemmaspec's loader checks
        want = "assistant" if model_type == "draft-mtp" else "target"
        role = read_model(args.model_draft).role
        if role != want:
            other = "draft-mtp" if role == "assistant" else "draft-simple"
            raise InputError(f"-md {args.model_draft} is {'an assistant' if role == 'assistant' else 'a model'}, which "
                             f"--spec-type {model_type} does not take: use --spec-type "
                             f"{spec.replace(model_type, other)}")
    if "," in spec and args.server != "llama-server":
        if given:
            raise InputError(f"{args.server} takes one speculative method; a list (--spec-type {spec}) is "
                             f"llama-server's and gemmaspec's: export one of {spec.replace(',', ', ')}")
        spec = "ngram-simple"  # gemmaspec's default list; its shipped assistant is gemmaspec's own format
        notes.append(f"{args.server} takes one speculative method and cannot load gemmaspec's shipped assistant: "
                     f"exporting ngram-simple (gemmaspec runs {drafter_plan.spec_type})")
    draft_file = drafter_plan.draft_file if spec_model_type(spec) else None
    dropped = _dropped(args.server, spec, drafter_plan)
    if dropped:
        notes.append(f"{args.server} gets no {', '.join(dropped)}: it has no flag for "
                     f"{'it' if len(dropped) == 1 else 'them'} here (its own defaults apply)")
    ctx = args.ctx_size if args.ctx_size else target_info.context_length if args.ctx_size == 0 \
        else min(4096, target_info.context_length)
    if args.server == "llama-server":
        from ..manage.default_model import default_model_path

        model = args.model or str(default_model_path())
        draft_entry = args.draft_entry if draft_file == args.model_draft else None
        for flag, p, entry in (("-m", model, args.target_entry), ("-md", draft_file, draft_entry)):
            if p and not str(p).endswith(".gguf"):
                if is_stand_in(p):
                    raise InputError(f"llama-server loads GGUF files; {entry.name} is a checkpoint directory"
                                     + _gguf_names(entry) + " (or pull it and gemmaspec convert it)")
                raise InputError(f"llama-server loads GGUF files; {flag} {p} is not one: convert it first "
                                 f"(gemmaspec convert {p} OUT.gguf)")
        cmd = ["llama-server", *_llama_model("-m", "--hf-repo", "--hf-file", model, args.target_entry),
               "--port", str(args.port), "-np", str(args.parallel),
               "-c", str(ctx * args.parallel)]  # llama-server's -c is shared by the slots: gemmaspec's per slot
        if spec != "none":
            cmd += ["--spec-type", spec, "--spec-draft-n-max", str(n)]
            if drafter_plan.spec.n_min:
                cmd += ["--spec-draft-n-min", str(drafter_plan.spec.n_min)]
            if "ngram-mod" in spec:  # llama.cpp's own drafter: the same settings
                cmd += ["--spec-ngram-mod-n-match", str(drafter_plan.spec.ngram_mod_n_match),
                        "--spec-ngram-mod-n-min", str(drafter_plan.spec.ngram_mod_n_min)]
            if draft_file:
                cmd += _llama_model("-md", "--hf-repo-draft", "--hf-file-draft", draft_file, draft_entry)
                if drafter_plan.p_min:
                    cmd += ["--spec-draft-p-min", f"{drafter_plan.p_min:g}"]
        _say(notes)
        return cmd
    target = _name_for_vllm(args.model, args.model, args.target_entry)
    draft = _name_for_vllm(draft_file, draft_file, args.draft_entry) if draft_file else None
    _say(notes)
    total, heads, ctx = _gpu_estimate(args.model, draft_file, ctx, args.parallel)
    tp = tensor_parallel(total, parse_mem(args.gpu_mem), heads)
    if args.server == "vllm":
        cmd = ["vllm", "serve", target, "--port", str(args.port), "--max-model-len", str(ctx),
               "--max-num-seqs", str(args.parallel), "--tensor-parallel-size", str(tp)]
        cfg = None
        if spec == "draft-mtp":
            cfg = {"method": "mtp", "model": draft, "num_speculative_tokens": n}
        elif spec == "draft-simple":
            cfg = {"method": "draft_model", "model": draft, "num_speculative_tokens": n}
        elif spec == "ngram-simple":
            cfg = {"method": "ngram", "num_speculative_tokens": n, "prompt_lookup_max": args.spec_ngram_size,
                   "prompt_lookup_min": args.spec_ngram_min}
        if cfg:
            cmd += ["--speculative-config", json.dumps(cfg)]
        return cmd
    cmd = ["python", "-m", "sglang.launch_server", "--model-path", target, "--port", str(args.port),
           "--context-length", str(ctx), "--max-running-requests", str(args.parallel), "--tp-size", str(tp)]
    if spec in ("draft-mtp", "draft-simple"):
        cmd += ["--speculative-algorithm", "NEXTN" if spec == "draft-mtp" else "STANDALONE",
                "--speculative-draft-model-path", draft, "--speculative-num-steps", str(n),
                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(n + 1)]
    elif spec == "ngram-simple":
        cmd += ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(n + 1)]
    return cmd


def _llama_model(flag: str, repo_flag: str, file_flag: str, path, entry) -> list[str]:
    """llama-server's flags for one model: ``-m FILE`` for a local file; for a catalog name not
    downloaded here, the hub file llama-server downloads itself (``--hf-repo REPO --hf-file FILE``, the
    file gemmaspec pull would fetch; llama-server keeps it in its own cache)."""
    if entry is not None and entry.repo and is_stand_in(path):
        return [repo_flag, entry.repo, file_flag, Path(path).name]
    return [flag, str(path)]


def _gguf_names(entry) -> str:
    from ..manage import catalog

    names = [e.name for e in catalog.entries() if e.format == "gguf" and e.hf_equivalent == entry.name]
    return f": export {' or '.join(names)} (its GGUF)" if names else ""


def _dropped(server: str, spec: str, drafter_plan) -> list[str]:
    """The speculative settings ``server``'s exported command cannot carry (named as gemmaspec's flags)."""
    s, out = drafter_plan.spec, []
    if "ngram-simple" in spec and server == "llama-server" and (s.ngram_size, s.ngram_min) != (4, 1):
        out.append(f"--spec-ngram-size {s.ngram_size} / --spec-ngram-min {s.ngram_min}")
    if server != "llama-server" and "ngram-mod" in spec:
        out.append("--spec-type ngram-mod (llama.cpp's drafter; none here: no speculation)")
    if server != "llama-server" and s.n_min:
        out.append(f"--spec-draft-n-min {s.n_min}")
    if server != "llama-server" and spec_model_type(spec) and drafter_plan.p_min:
        out.append(f"--spec-draft-p-min {drafter_plan.p_min:g}")
    return out


def _say(notes: list[str]) -> None:
    for note in notes:
        print(f"note: {note}", file=sys.stderr)


def run(args) -> int:
    """``gemmaspec export``: print the command (shell-quoted) on stdout."""
    resolve_models(args, metadata=True)  # a known name not downloaded: its metadata from the hub, no weights
    print(shlex.join(build_command(args)))
    return 0
