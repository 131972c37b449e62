"""Seeds as llama.cpp reads them (kept free of torch: the command line reads ``--seed`` with it)."""

from __future__ import annotations

SEED_RANDOM = 0xFFFFFFFF
"""llama.cpp's ``LLAMA_DEFAULT_SEED``: the uint32 that asks for a random seed (what -1 wraps to)."""


def llama_seed(seed: int) -> int:
    """A seed as llama.cpp reads it: an unsigned 32-bit integer, so any integer wraps modulo 2**32
    (-2 is 4294967294, 2**32 + 5 is 5) and 4294967295 (-1) asks for a random one. Source: llama.cpp
    ``common/common.h`` (``uint32_t seed = LLAMA_DEFAULT_SEED``), read from JSON with a cast to
    ``uint32_t`` and from ``--seed`` with ``std::stoul``; OpenAI and vLLM take any 64-bit integer.

    Returns:
        -1 for a random seed, else the seed in 0..4294967294 (:attr:`SamplingParams.seed`'s range).
    """
    s = int(seed) % (1 << 32)
    return -1 if s == SEED_RANDOM else s
