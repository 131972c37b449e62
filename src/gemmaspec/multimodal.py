"""Prompts with images: the image placeholders expanded to the vision tower's tokens, and the images
encoded into the embeddings the target reads at those positions.

The tower says how an image is written (``image_text(n)``: for Gemma 3, blank lines, BOI, one
placeholder token per soft token, EOI, blank lines; for Gemma 4, BOI, placeholders, EOI; as
transformers' processors write them), how many soft tokens an image has (``image_tokens(image)``:
fixed for Gemma 3, from the image's size for Gemma 4) and which marker stands for an image in a
prompt (``placeholders()``: the chat template's ``<start_of_image>`` or ``<|image|>``).
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


def _spans(ids: list[int], image_id: int, counts: list[int]) -> list[int]:
    """Where each image's placeholder run starts: runs of ``image_id`` taken in order, each holding
    whole images of ``counts[i]`` tokens (a raw prompt may spell several images in one run)."""
    starts, i, k = [], 0, 0
    while i < len(ids):
        if ids[i] != image_id:
            i += 1
            continue
        run = i
        while run < len(ids) and ids[run] == image_id:
            run += 1
        at = i
        while at < run and k < len(counts):
            starts.append(at)
            at, k = at + counts[k], k + 1
        if at != run:
            raise InputError(f"the prompt spells {run - i} image placeholder tokens where its images have "
                             f"{at - i if at > i else 0}")
        i = run
    return starts


def _expand(text: str, marker: str, vision, images: list[Image]) -> str:
    """``text`` with its i-th ``marker`` replaced by the tower's text for image i (its own token count)."""
    parts = text.split(marker)
    out = [parts[0]]
    for im, part in zip(images, parts[1:]):
        out += [vision.image_text(vision.image_tokens(im)), part]
    return "".join(out)


MARK = "\ufdd3"
"""Where an image goes in a chat message's text (a noncharacter: no one types it), replaced by the
tower's image text once the template has rendered the messages."""


def image_prompt(tokenizer, vision, prompt: str, images: list[Image], chat: bool = False,
                 system: str | None = None) -> tuple[list[int], list[ImageSpan]]:
    """Token ids of ``prompt`` with ``images`` in it, and where each image's embeddings go.

    Raw prompts: each image marker spelled in the prompt (``<start_of_image>``) takes the next image;
    without markers the images come first. Chat prompts (``chat``): one user turn (after an optional
    system message) with the images first (:func:`chat_image_ids`).

    Raises:
        InputError: marker count and image count differ, the tokenizer lacks the image tokens, or
            (chat) see :func:`chat_image_ids`.
    """
    marker, _ = vision.placeholders()
    if chat:
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": MARK * len(images) + prompt}]
        return chat_image_ids(tokenizer, vision, msgs, images)
    _image_id(tokenizer, vision)
    text = prompt if marker in prompt else marker * len(images) + prompt
    if text.count(marker) != len(images):
        raise InputError(f"the prompt has {text.count(marker)} image markers ({marker}) for {len(images)} images")
    return _with_images(tokenizer, vision, tokenizer.encode(_expand(text, marker, vision, images)), images)


def marked_prompt(tokenizer, vision, text: str, images: list[Image], marker: str) -> tuple[list[int], list]:
    """Token ids of a raw prompt in which each ``marker`` (llama-server's ``<__media__>``) stands for
    the next of ``images``, and where each image's embeddings go: every marker replaced by the
    tower's image text, then tokenized as :func:`image_prompt` does (control-token spellings parsed,
    BOS added). Unlike :func:`image_prompt`, the images never move to the front.

    Raises:
        InputError: marker count and image count differ, or the tokenizer lacks the image tokens.
    """
    _image_id(tokenizer, vision)
    if text.count(marker) != len(images):
        raise InputError(f"the prompt has {text.count(marker)} {marker} markers for {len(images)} images: "
                         f"each image needs one marker where it goes, in order")
    parts = text.split(marker)  # each marker becomes its own image's text (Gemma 4's length varies by image)
    filled = parts[0] + "".join(vision.image_text(vision.image_tokens(im)) + part for im, part in zip(images, parts[1:]))
    return _with_images(tokenizer, vision, tokenizer.encode(filled), images)


def chat_image_ids(tokenizer, vision, messages: list[dict], images: list[Image], encoded: dict | None = None,
                   **template) -> tuple[list, list]:
    """A chat prompt whose message contents hold :data:`MARK` where each image goes: rendered with the
    template (``template``: :meth:`~gemmaspec.tokenizer.GemmaTokenizer.encode_chat`'s options), each
    mark replaced by the tower's image text (transformers' processor does the same to the template's
    ``<start_of_image>``), then tokenized; ``(ids, spans)``. ``encoded``: an image key → embeddings
    cache kept by the caller (a conversation re-renders its images every turn), filled here.

    Raises:
        InputError: a user or system message spells a control token (with images the contents cannot
            be kept apart from the template's text; an assistant's spelled control tokens are taken as
            those tokens), the template dropped or repeated a mark, or see
            :func:`image_prompt`.
    """
    _image_id(tokenizer, vision)
    for m in messages:  # an assistant's reply is the model's own tokens: its control tokens stay so
        content = m.get("content")
        if m.get("role") != "assistant" and isinstance(content, str) and tokenizer.special_ids.intersection(
                tokenizer.encode(content.replace(MARK, ""), add_bos=False)):
            raise InputError("a conversation with images cannot have messages that spell control tokens "
                             "(such as <start_of_turn>); remove them")
    text = tokenizer.apply_chat_template(messages, **template)
    if text.count(MARK) != len(images):
        raise InputError(f"the chat template wrote {text.count(MARK)} of the {len(images)} images")
    return _with_images(tokenizer, vision, tokenizer.encode(_expand(text, MARK, vision, images)), images, encoded)


def _image_id(tokenizer, vision) -> int:
    marker, image_token = vision.placeholders()
    image_id = tokenizer.token_to_id(image_token)
    if image_id is None or tokenizer.token_to_id(marker) is None:
        raise InputError(f"the model's tokenizer has no {marker} / {image_token} tokens: it is not a vision model")
    return image_id


def _with_images(tokenizer, vision, ids: list[int], images: list[Image], encoded: dict | None = None):
    starts = _spans(ids, _image_id(tokenizer, vision), [vision.image_tokens(im) for im in images])
    if len(starts) != len(images):
        raise InputError(f"the prompt holds {len(starts)} images' placeholders for {len(images)} images")
    cache = {} if encoded is None else encoded
    new = [im for im in {im.key: im for im in images}.values() if im.key not in cache]
    if new:
        cache.update(zip((im.key for im in new), vision.embed(new)))
    return ids, [ImageSpan(s, cache[im.key], im.key) for s, im in zip(starts, images)]


def keyed(ids: list[int], images) -> list:
    """``ids`` with each image's placeholder positions replaced by negative numbers drawn from its
    pixels' hash and the position in the image: two prompts share a prefix in this form exactly when
    they share the tokens and the images (what prompt-cache reuse compares)."""
    if not images:
        return list(ids)
    out = list(ids)
    for im in images:
        base = int(im.key[:10], 16) << 16  # below 2**56: fits an int64 (a saved slot file)
        for j in range(im.end - im.start):
            out[im.start + j] = -1 - base - j
    return out


def non_text_ids(tokenizer, vision) -> frozenset[int]:
    """The placeholder token ids of a tower's images (not text: n-gram lookup must not copy them)."""
    if vision is None:
        return frozenset()
    tid = tokenizer.token_to_id(vision.placeholders()[1])
    return frozenset() if tid is None else frozenset({tid})
