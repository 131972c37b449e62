"""Typed model configurations, read from checkpoint metadata (never from file names).

Source of the Gemma 3 defaults that the GGUF leaves out: transformers
``models/gemma3/configuration_gemma3.py`` (``rope_local_base_freq`` 10,000, ``query_pre_attn_scalar``
= head dim, one global layer in six) and llama.cpp ``src/llama-model.cpp`` (same values).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Gemma3Config:
    """Gemma 3 text model hyper-parameters.

    Attributes mirror the GGUF keys ``gemma3.*`` (names in comments). ``layer_types[i]`` is
    ``"sliding"`` or ``"full"``.
    """

    vocab_size: int
    hidden_size: int  # embedding_length
    num_layers: int  # block_count
    intermediate_size: int  # feed_forward_length
    num_heads: int  # attention.head_count
    num_kv_heads: int  # attention.head_count_kv
    head_dim: int  # attention.key_length
    rms_norm_eps: float = 1e-6  # attention.layer_norm_rms_epsilon
    context_length: int = 32768  # context_length
    sliding_window: int = 512  # attention.sliding_window
    rope_theta_global: float = 1_000_000.0  # rope.freq_base
    rope_theta_local: float = 10_000.0  # not stored in Gemma 3 GGUFs
    rope_scaling_factor: float = 1.0  # rope.scaling.factor (linear, global layers only)
    query_pre_attn_scalar: float = 256.0  # not stored in Gemma 3 GGUFs
    sliding_window_pattern: int = 6  # layer i is global when (i + 1) % pattern == 0
    final_logit_softcapping: float | None = None
    layer_types: tuple[str, ...] = field(default=())
    bos_token_id: int = 2
    eos_token_id: int = 1
    architecture: str = "gemma3"

    def __post_init__(self) -> None:
        if not self.layer_types:
            types = tuple(
                "full" if (i + 1) % self.sliding_window_pattern == 0 else "sliding"
                for i in range(self.num_layers)
            )
            object.__setattr__(self, "layer_types", types)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Gemma3Config":
        data = json.loads(text)
        data["layer_types"] = tuple(data.get("layer_types", ()))
        return cls(**data)
