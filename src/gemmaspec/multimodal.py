"""Prompts with images: the image placeholders expanded to the vision tower's tokens, and the images
encoded into the embeddings the target reads at those positions.

The tower says how an image is written (``image_text()``: for Gemma 3, blank lines, BOI, one
placeholder token per soft token, EOI, blank lines, as transformers' processor writes it) and which
marker stands for an image in a prompt (``placeholders()``: the chat template's ``<start_of_image>``).
A raw prompt may spell the marker where each image goes (else the images come first, as
llama-mtmd-cli puts them); a chat prompt gets the images at the start of the user's turn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError
from .images import Image


@dataclass(frozen=True)
class ImageSpan:
    """One image in a prompt: its placeholder tokens are ``ids[start : start + len(embeddings)]``;
    ``embeddings`` float32 [tokens per image, hidden] replace theirs; ``key`` hashes the pixels."""

    start: int
    embeddings: torch.Tensor
    key: str

    @property
    def end(self) -> int:
        return self.start + self.embeddings.shape[0]


def _spans(ids: list[int], image_id: int, n: int) -> list[int]:
    starts, i = [], 0
    while i < len(ids):
        if ids[i] == image_id:
            run = i
            while run < len(ids) and ids[run] == image_id:
                run += 1
            if (run - i) % n:
                raise InputError(f"the prompt spells {run - i} image placeholder tokens; an image has {n}")
            starts += list(range(i, run, n))
            i = run
        else:
            i += 1
    return starts


def image_prompt(tokenizer, vision, prompt: str, images: list[Image], chat: bool = False,
                 system: str | None = None) -> tuple[list[int], list[ImageSpan]]:
    """Token ids of ``prompt`` with ``images`` in it, and where each image's embeddings go.

    Raw prompts: each image marker spelled in the prompt (``<start_of_image>``) takes the next image;
    without markers the images come first. Chat prompts (``chat``): one user turn (after an optional
    system message) with the images first, the prompt as text.

    Raises:
        InputError: marker count and image count differ, the tokenizer lacks the image tokens, or the
            chat template changes the message so the images cannot be placed.
    """
    marker, image_token = vision.placeholders()
    image_id = tokenizer.token_to_id(image_token)
    if image_id is None or tokenizer.token_to_id(marker) is None:
        raise InputError(f"the model's tokenizer has no {marker} / {image_token} tokens: it is not a vision model")
    full = vision.image_text()
    if not chat:
        text = prompt if marker in prompt else marker * len(images) + prompt
        if text.count(marker) != len(images):
            raise InputError(f"the prompt has {text.count(marker)} image markers ({marker}) for {len(images)} images")
        ids = tokenizer.encode(text.replace(marker, full))
    else:
        mark = "\ufdd3"
        if mark in prompt or (system and mark in system):
            raise InputError("the prompt contains U+FDD3 (a noncharacter); remove it")
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": mark * len(images) + prompt}]
        pieces = tokenizer.apply_chat_template(msgs).split(mark)
        text, rest = pieces[0] + "".join(pieces[1:-1]), pieces[-1]
        core = prompt.strip()
        if len(pieces) != len(images) + 1 or not rest.startswith(core):
            raise InputError("this chat template changes the user's message, so images cannot be placed in it")
        head = text + full * len(images)
        ids = (tokenizer.encode(head[:-2] if head.endswith("\n\n") else head)
               + tokenizer.encode_text("\n\n" + core if head.endswith("\n\n") else core, add_bos=False)
               + tokenizer.encode(rest[len(core):], add_bos=False))
    starts = _spans(ids, image_id, vision.tokens_per_image)
    if len(starts) != len(images):
        raise InputError(f"the prompt holds {len(starts)} images' placeholders for {len(images)} images")
    emb = vision.encode(torch.stack([im.pixels for im in images])) if images else []
    return ids, [ImageSpan(s, emb[i], im.key) for i, (s, im) in enumerate(zip(starts, images))]


def non_text_ids(tokenizer, vision) -> frozenset[int]:
    """The placeholder token ids of a tower's images (not text: n-gram lookup must not copy them)."""
    if vision is None:
        return frozenset()
    tid = tokenizer.token_to_id(vision.placeholders()[1])
    return frozenset() if tid is None else frozenset({tid})
