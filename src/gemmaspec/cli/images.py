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
                        "checkpoint directory (Gemma 3, Gemma 4)")


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
    from ..multimodal import image_prompt

    vision = load_projector(args.mmproj, engine)
    images = [read_image(f, vision) for f in args.image]
    return image_prompt(engine.tokenizer, vision.model, prompt, images, chat=args.chat, system=args.system_prompt)


def load_projector(path, engine):
    """The vision tower of ``--mmproj``, checked against the engine's model.

    Raises:
        InputError: a model that takes no images, or a projector of another width.
        ModelFileError: an unreadable projector.
    """
    from ..loading.vision import check_pair, load_vision

    if "images" not in inspect.signature(engine.model.forward).parameters:
        raise InputError("this model does not take images (Gemma 3 and Gemma 4 targets do)")
    vision = load_vision(path, device=getattr(engine.model, "device", "cpu"))
    check_pair(vision, engine.model.config)
    return vision


def read_image(path: str, vision):
    """An image file prepared for ``vision``. Raises InputError: unreadable or bad image."""
    from ..images import prepare

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read the image {path}: {exc.strerror or exc}") from None
    return prepare(data, vision.config, where=path)


class ChatImages:
    """Images in ``gemmaspec chat``: ``/image FILE`` attaches an image to the next message; each turn's
    prompt is rendered with every image still in the conversation (their embeddings computed once)."""

    def __init__(self, engine, vision, err):
        self.engine, self.vision, self.err = engine, vision, err
        self.pending: list = []
        self.encoded: dict = {}

    def command(self, text: str) -> bool:
        """Handle ``/image FILE`` (True), or say it is not one (False). Errors are one line on stderr."""
        word, _, rest = text.strip().partition(" ")
        if word != "/image":
            return False
        if self.vision is None:
            print("error: /image needs the model's vision projector: start chat with --mmproj FILE", file=self.err)
        elif not rest.strip():
            print("error: /image FILE: give the image's path", file=self.err)
        else:
            try:
                self.pending.append(read_image(rest.strip(), self.vision))
                print(f"({rest.strip()} goes with your next message)", file=self.err)
            except InputError as exc:
                print(f"error: {exc}", file=self.err)
        return True

    def message(self, text: str) -> dict:
        """The user message for ``text``, with the pending images first."""
        from ..multimodal import MARK

        msg = {"role": "user", "content": MARK * len(self.pending) + text}
        if self.pending:
            msg["_images"], self.pending = self.pending, []
        return msg

    def encode(self, head: list, turns: list):
        """``(ids, image spans)`` of the conversation, or ``(None, None)`` when its images cannot be
        placed (said on stderr)."""
        images = [im for t in turns for im in t.get("_images", ())]
        if not images:
            return self.engine.tokenizer.encode_chat(head + turns), []
        from ..multimodal import chat_image_ids

        msgs = [{"role": m["role"], "content": m["content"]} for m in head + turns]
        try:
            return chat_image_ids(self.engine.tokenizer, self.vision.model, msgs, images, encoded=self.encoded)
        except InputError as exc:
            print(f"error: {exc}", file=self.err)
            return None, None
