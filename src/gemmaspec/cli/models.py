"""Model management commands: ``pull``, ``models``, ``fit`` and ``inspect``."""

from __future__ import annotations

from .args import add_spec


def add_parsers(sub) -> None:
    """Register ``inspect``, ``pull``, ``models`` and ``fit`` on the ``gemmaspec`` subparsers."""
    i = sub.add_parser("inspect", help="print a model file's architecture, config and tensor types", allow_abbrev=False)
    i.add_argument("model", help="GGUF model file")

    pl = sub.add_parser("pull", help="download a known model or REPO[:FILE] from the Hugging Face Hub, sha256-checked",
                        allow_abbrev=False)
    pl.add_argument("spec", metavar="NAME|REPO[:FILE]", help="a name from gemmaspec models, a repo, or repo:file")
    pl.add_argument("--revision", default=None, help="branch, tag or commit to pin (default main)")
    pl.add_argument("--sha256", default=None, help="expected sha256 of the file; a mismatch deletes the download")
    pl.add_argument("--with-assistant", action="store_true",
                    help="also fetch the target's assistant (a QAT target gets its QAT assistant)")

    ms = sub.add_parser("models", help="list the known models (targets, assistants), their pairs and what is cached",
                        allow_abbrev=False)
    ms.add_argument("--json", action="store_true",
                    help="one JSON array for scripts: each model's name, role, pair, repo, file, sha256, cached path")

    f = sub.add_parser("fit", help="will it fit? memory of a model, its drafter and KV cache, from metadata only",
                       allow_abbrev=False)
    f.add_argument("-m", "--model", default=None, help="model file, directory or known name (default: the embedded one)")
    f.add_argument("-c", "--ctx-size", type=int, default=None, help="context per slot (0 = the model's; default 4096 "
                   "or the model's, if smaller)")
    f.add_argument("-np", "--parallel", type=int, default=1, help="slots (sequences served at once; default 1)")
    f.add_argument("--device", default="auto",
                   help="cpu, cuda (their free memory), auto, or a memory size to check against (e.g. 8GiB, 512M)")
    add_spec(f)  # the drafter counted is the one generate and serve would load


def run_inspect(args) -> int:
    """``gemmaspec inspect MODEL``: what a GGUF file holds, on stdout."""
    from ..loading.inspect import describe_gguf

    print(describe_gguf(args.model))
    return 0


def run_pull(args) -> int:
    """``gemmaspec pull``: download, then print each file's label and path (and sha256)."""
    from ..manage.hub import pull

    for p in pull(args.spec, revision=args.revision, sha256=args.sha256, with_assistant=args.with_assistant):
        print(f"{p.label}: {p.path}" + (f" (sha256 {p.sha256})" if p.sha256 else ""))
    return 0


def models_json() -> list[dict]:
    """The catalog for scripts: per entry ``name``, ``role``, ``format``, ``qat``, ``pair`` (its
    assistant or target), ``repo``, ``file`` (None when picked from the repo's listing: ``file_glob``),
    ``sha256`` (the pinned hash, None when the hub's LFS hash is what is checked), ``package``,
    ``hf_equivalent``, ``draft_n_max``, ``spec_type``, ``default``, ``placeholder``, ``source`` (the
    citation), ``note``, ``cached`` (the local path, None when not downloaded)."""
    from ..manage import catalog
    from ..manage.hub import cached_path

    out = []
    for e in catalog.entries():
        try:
            where = cached_path(e)
        except Exception:  # noqa: BLE001 - a listing never fails on one entry
            where = None
        out.append({"name": e.name, "role": e.role, "format": e.format, "qat": e.qat,
                    "pair": e.assistant if e.role == "target" else e.target, "repo": e.repo, "file": e.file,
                    "file_glob": e.file_glob, "sha256": e.sha256, "package": e.package,
                    "hf_equivalent": e.hf_equivalent, "draft_n_max": e.draft_n_max, "spec_type": e.spec_type,
                    "default": e.default, "placeholder": e.placeholder,
                    "source": catalog.sources().get(e.source, e.source), "note": e.note,
                    "cached": str(where) if where else None})
    return out


def run_models(args) -> int:
    """``gemmaspec models``: the catalog as a table, with what is cached (``--json``: as JSON)."""
    from ..manage import catalog
    from ..manage.hub import cached_path

    if getattr(args, "json", False):
        import json

        print(json.dumps(models_json(), indent=1))
        return 0
    print(f"{'name':<44} {'role':<9} {'qat':<3} {'n_max':>5}  {'cached':<6} repo / pair")
    for e in catalog.entries():
        try:
            where = cached_path(e)
        except Exception:  # noqa: BLE001 - a listing never fails on one entry
            where = None
        partner = e.assistant if e.role == "target" else e.target
        repo = e.repo or e.package or ("(placeholder)" if e.placeholder else "(repo not recorded)")
        if e.file:
            repo += f":{e.file}"
        n = "" if e.draft_n_max is None else str(e.draft_n_max)
        print(f"{e.name:<44} {e.role:<9} {'yes' if e.qat else 'no':<3} {n:>5}  {'yes' if where else 'no':<6} "
              f"{repo}" + (f"  (pair: {partner})" if partner else ""))
    print("\nn_max: the draft length used when --spec-draft-n-max is not given; sources in "
          "src/gemmaspec/manage/catalog.json")
    return 0


def run_fit(args) -> int:
    """``gemmaspec fit``: the memory table; exit status 0 when it fits, 1 when not.

    Raises:
        InputError: an assistant given as -m, bad flags.
    """
    from ..manage.fit import device_and_free, estimate, read_model
    from .args import read_target, spec_plan

    plan = spec_plan(args, metadata=True)  # names resolved to paths (a name not downloaded: its metadata from
    # the hub, no weights); the drafter generate and serve would load
    target = read_target(args.model)
    device, free = device_and_free(args.device)
    draft = read_model(plan.draft_file) if plan.draft_file else None
    est = estimate(target, draft, args.ctx_size, args.parallel, device, free)
    print(est.table())
    print(plan.line())
    return 0 if est.fits else 1


COMMANDS = {"inspect": run_inspect, "pull": run_pull, "models": run_models, "fit": run_fit}
