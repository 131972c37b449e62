"""Image flags of the front ends: ``--image FILE`` (llama-mtmd-cli's) and ``--mmproj FILE``
(llama-server's and llama-mtmd-cli's: the model's vision projector, an mmproj GGUF or a multimodal
checkpoint directory)."""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

from ..errors import InputError


def add_image_flags(p: argparse.ArgumentParser) -> None:
    """``--image FILE`` (repeatable) and ``--mmproj FILE``."""
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image for the prompt (PNG, JPEG, WebP, GIF, BMP; repeatable); needs --mmproj")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="the model's vision projector: an mmproj GGUF (llama.cpp's) or the multimodal "
                        "checkpoint directory (Gemma 3)")


def image_prompt_ids(args, engine, prompt: str):
    """``(ids, image spans)`` for a prompt with ``--image`` files, or None without images.

    Raises:
        InputError: ``--image`` without ``--mmproj``, an unreadable or bad image, a projector that does
            not fit the model. ModelFileError: an unreadable projector file.
    """
    if not args.image:
        return None
    if not args.mmproj:
        raise InputError("--image needs --mmproj FILE: the vision projector released with the model "
                         "(mmproj-*.gguf, or the multimodal checkpoint directory)")
    from ..images import prepare
    from ..loading.vision import check_pair, load_vision
    from ..multimodal import image_prompt

    if "images" not in inspect.signature(engine.model.forward).parameters:
        raise InputError("this model does not take images (only Gemma 3 targets do so far)")
    vision = load_vision(args.mmproj, device=getattr(engine.model, "device", "cpu"))
    check_pair(vision, engine.model.config)
    images = []
    for f in args.image:
        try:
            data = Path(f).read_bytes()
        except OSError as exc:
            raise InputError(f"cannot read the image {f}: {exc.strerror or exc}") from None
        images.append(prepare(data, vision.config, where=f))
    return image_prompt(engine.tokenizer, vision.model, prompt, images, chat=args.chat, system=args.system_prompt)
