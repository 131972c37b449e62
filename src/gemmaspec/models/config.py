"""Typed model configurations, read from checkpoint metadata (never from file names).

Source of the Gemma 3 defaults that the GGUF leaves out: transformers
``models/gemma3/configuration_gemma3.py`` (``rope_local_base_freq`` 10,000, ``query_pre_attn_scalar``
= head dim, one global layer in six) and llama.cpp ``src/llama-model.cpp`` (same values).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from ..errors import ModelFileError


class VisionJSON:
    """``to_json`` / ``from_json`` of the vision towers' frozen config dataclasses (the configs cached
    with a converted tower): every field as JSON, lists read back as tuples (image mean and std)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str):
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(text).items()})


def hf_vision_parts(cfg: dict, need: tuple[str, ...]) -> tuple[dict, dict]:
    """``(vision_config, text_config)`` of a multimodal ``config.json`` dict.

    Raises:
        ValueError: no ``vision_config`` (a text-only checkpoint), or a key of ``need`` missing from it,
            or no ``text_config.hidden_size``.
    """
    v, t = cfg.get("vision_config"), cfg.get("text_config") or {}
    if not isinstance(v, dict):
        raise ValueError("config.json has no vision_config: a text-only checkpoint has no vision tower")
    missing = [k for k in need if k not in v] + ([] if "hidden_size" in t else ["text_config.hidden_size"])
    if missing:
        raise ValueError(f"config.json lacks vision_config {', '.join(missing)}")
    return v, t


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

    @classmethod
    def from_hf(cls, cfg: dict) -> "Gemma3Config":
        """From a transformers ``config.json`` dict (``Gemma3TextConfig``, or the ``text_config`` of a
        multimodal ``gemma3`` checkpoint). Reads both RoPE layouts: ``rope_parameters`` per layer type
        (transformers 5) and ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` (4.x).

        Raises:
            ValueError: a required key is missing.
        """
        c = cfg.get("text_config", cfg)
        need = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim")
        missing = [k for k in need if k not in c]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        rope = c.get("rope_parameters") or {}
        full, slide = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        scaling = full or c.get("rope_scaling") or {}
        factor = float(scaling.get("factor", 1.0)) if scaling.get("rope_type", scaling.get("type")) == "linear" else 1.0
        types = tuple("full" if t == "full_attention" else "sliding" for t in (c.get("layer_types") or ()))
        eos = c.get("eos_token_id", 1)
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
            intermediate_size=c["intermediate_size"], num_heads=c["num_attention_heads"],
            num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"], rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            context_length=c.get("max_position_embeddings", 32768), sliding_window=c.get("sliding_window", 512),
            rope_theta_global=float(full.get("rope_theta", c.get("rope_theta", 1_000_000.0))),
            rope_theta_local=float(slide.get("rope_theta", c.get("rope_local_base_freq", 10_000.0))),
            rope_scaling_factor=factor, query_pre_attn_scalar=float(c.get("query_pre_attn_scalar", c["head_dim"])),
            sliding_window_pattern=int(c.get("sliding_window_pattern", c.get("_sliding_window_pattern", 6)) or 6),
            final_logit_softcapping=c.get("final_logit_softcapping"), layer_types=types,
            bos_token_id=c.get("bos_token_id", 2), eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )

    @classmethod
    def from_gguf(cls, meta) -> "Gemma3Config":
        """From a ``gemma3`` GGUF's metadata (:class:`~gemmaspec.loading.gguf.GGUFMeta`), with the
        Gemma 3 defaults for the keys llama.cpp's converter leaves out (module docstring).

        Raises:
            ModelFileError: a required key, or the tokenizer, is missing.
        """
        vocab = meta.array_len("tokenizer.ggml.tokens")
        if vocab is None:
            raise ModelFileError(f"{meta.path}: the file has no tokenizer (tokenizer.ggml.tokens); it cannot generate text")
        head_dim = int(meta.require("attention.key_length"))
        scaling = meta.arch_get("rope.scaling.factor")
        return cls(
            vocab_size=vocab,
            hidden_size=int(meta.require("embedding_length")),
            num_layers=int(meta.require("block_count")),
            intermediate_size=int(meta.require("feed_forward_length")),
            num_heads=int(meta.require("attention.head_count")),
            num_kv_heads=int(meta.require("attention.head_count_kv")),
            head_dim=head_dim,
            rms_norm_eps=float(meta.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(meta.arch_get("context_length", 32768)),
            sliding_window=int(meta.arch_get("attention.sliding_window", 512)),
            rope_theta_global=float(meta.arch_get("rope.freq_base", 1_000_000.0)),
            rope_scaling_factor=float(scaling) if scaling else 1.0,
            query_pre_attn_scalar=float(head_dim),
            final_logit_softcapping=meta.arch_get("final_logit_softcapping"),
            bos_token_id=int(meta.get("tokenizer.ggml.bos_token_id", 2)),
            eos_token_id=int(meta.get("tokenizer.ggml.eos_token_id", 1)),
        )


BIDIRECTIONAL_VISION_KEY = "attention.bidirectional_vision"
"""A key of our own (``gemma4.attention.bidirectional_vision``, bool) that ``gemmaspec convert``
writes only when a checkpoint's ``use_bidirectional_attention`` disagrees with
:func:`llama_cpp_bidirectional_vision`; llama.cpp's converter stores no such setting."""


def llama_cpp_bidirectional_vision(hidden_size: int) -> bool:
    """Whether a Gemma 4 GGUF's image tokens attend to each other (on sliding layers) when the file
    does not say: llama.cpp's rule (``mtmd_decode_use_non_causal``): yes, except for E2B and E4B
    (widths 1536 and 2560), which the released checkpoints mark causal (``use_bidirectional_attention``
    unset there, ``"vision"`` on the larger models)."""
    return hidden_size not in (1536, 2560)


@dataclass(frozen=True)
class Gemma4Config:
    """Gemma 4 text model hyper-parameters (transformers ``Gemma4TextConfig``; GGUF arch ``gemma4``).

    Sliding layers use ``head_dim`` and RoPE base ``rope_theta_local`` over the whole head; full layers
    use ``global_head_dim`` and "proportional" RoPE: only the first ``partial_rotary_factor`` of the
    frequencies rotate, with base ``rope_theta_global``. The last ``num_kv_shared_layers`` layers
    have no K/V projections and read the K/V of the last earlier layer of the same type.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_kv_heads: int | None = None  # full layers when attention_k_eq_v
    rms_norm_eps: float = 1e-6
    context_length: int = 131072
    sliding_window: int = 512
    rope_theta_local: float = 10_000.0
    rope_theta_global: float = 1_000_000.0
    partial_rotary_factor: float = 0.25
    final_logit_softcapping: float | None = 30.0
    layer_types: tuple[str, ...] = field(default=())
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    bos_token_id: int = 2
    eos_token_id: int = 1
    pad_token_id: int = 0  # image rows take its per-layer embedding
    bidirectional_vision: bool = False  # use_bidirectional_attention == "vision": images see each other (sliding layers)
    architecture: str = "gemma4"

    def __post_init__(self) -> None:
        if not self.layer_types:
            types = tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(self.num_layers))
            object.__setattr__(self, "layer_types", types)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")

    def layer_kv_heads(self, i: int) -> int:
        if self.layer_types[i] == "full" and self.attention_k_eq_v and self.num_global_kv_heads:
            return self.num_global_kv_heads
        return self.num_kv_heads

    def layer_head_dim(self, i: int) -> int:
        return self.global_head_dim if self.layer_types[i] == "full" else self.head_dim

    def kv_source(self) -> list[int]:
        """For each layer, the layer whose K/V it attends over (itself unless KV-shared).

        Raises:
            ValueError: a shared layer's type has no earlier unshared layer to read from.
        """
        first_shared = self.num_layers - self.num_kv_shared_layers
        last_of_type = {}
        for i in range(first_shared):
            last_of_type[self.layer_types[i]] = i
        src = []
        for i in range(self.num_layers):
            if i < first_shared:
                src.append(i)
            elif self.layer_types[i] in last_of_type:
                src.append(last_of_type[self.layer_types[i]])
            else:
                raise ValueError(f"KV-shared layer {i} ({self.layer_types[i]}) has no earlier layer of its type")
        return src

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Gemma4Config":
        data = json.loads(text)
        data["layer_types"] = tuple(data.get("layer_types", ()))
        return cls(**data)

    @classmethod
    def from_gguf(cls, meta) -> "Gemma4Config":
        """From a ``gemma4`` or ``gemma4-assistant`` GGUF's metadata and tensor table
        (:class:`~gemmaspec.loading.gguf.GGUFMeta`), as llama.cpp's converter writes them: per-type
        head dims (``key_length`` = full, ``key_length_swa`` = sliding), the sliding pattern as a bool
        array, per-layer KV-head and FFN arrays, partial RoPE from ``rope_freqs`` (factor 1e30 = still).

        Raises:
            ModelFileError: a required key is missing.
        """
        n = int(meta.require("block_count"))
        pattern = meta.arch_get("attention.sliding_window_pattern")
        types = tuple("sliding" if s else "full" for s in pattern) if isinstance(pattern, list) else ()
        kv = meta.require("attention.head_count_kv")
        kv_list = kv if isinstance(kv, list) else [kv] * n
        ff = meta.require("feed_forward_length")
        full_kv = [k for k, t in zip(kv_list, types) if t == "full"]
        slide_kv = [k for k, t in zip(kv_list, types) if t == "sliding"]
        global_hd = int(meta.require("attention.key_length"))
        partial = 0.25
        rope_freqs = meta.tensor_array("rope_freqs.weight")
        if rope_freqs is not None:
            partial = 2 * int((rope_freqs < 1e29).sum()) / global_hd
        shapes = meta.tensor_shapes
        k_eq_v = any(f"blk.{i}.attn_k.weight" in shapes and f"blk.{i}.attn_v.weight" not in shapes
                     for i, t in enumerate(types) if t == "full")
        ple = shapes.get("per_layer_token_embd.weight")
        vocab = meta.array_len("tokenizer.ggml.tokens")
        if vocab is None:
            vocab = shapes["token_embd.weight"][0] if "token_embd.weight" in shapes else 0
        return cls(
            vocab_size=vocab, hidden_size=int(meta.require("embedding_length")), num_layers=n,
            intermediate_size=int(ff[0] if isinstance(ff, list) else ff),
            num_heads=int(meta.require("attention.head_count")),
            num_kv_heads=int(slide_kv[0] if slide_kv else kv_list[0]),
            head_dim=int(meta.require("attention.key_length_swa")), global_head_dim=global_hd,
            num_global_kv_heads=int(full_kv[0]) if full_kv else None,
            rms_norm_eps=float(meta.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(meta.arch_get("context_length", 131072)),
            sliding_window=int(meta.require("attention.sliding_window")),
            rope_theta_local=float(meta.arch_get("rope.freq_base_swa", 10_000.0)),
            rope_theta_global=float(meta.arch_get("rope.freq_base", 1_000_000.0)),
            partial_rotary_factor=partial, final_logit_softcapping=meta.arch_get("final_logit_softcapping"),
            layer_types=types, hidden_size_per_layer_input=int(meta.arch_get("embedding_length_per_layer_input", 0)),
            vocab_size_per_layer_input=int(ple[0]) if ple is not None else 0,
            attention_k_eq_v=k_eq_v, num_kv_shared_layers=int(meta.arch_get("attention.shared_kv_layers", 0)),
            use_double_wide_mlp=isinstance(ff, list) and len(set(ff)) > 1,
            enable_moe_block=bool(meta.arch_get("expert_count", 0)),
            num_experts=int(meta.arch_get("expert_count", 0)),
            top_k_experts=int(meta.arch_get("expert_used_count", 0)),
            moe_intermediate_size=int(meta.arch_get("expert_feed_forward_length", 0)),
            bos_token_id=int(meta.get("tokenizer.ggml.bos_token_id", 2)),
            eos_token_id=int(meta.get("tokenizer.ggml.eos_token_id", 1)),
            pad_token_id=int(meta.get("tokenizer.ggml.padding_token_id", 0) or 0),
            bidirectional_vision=meta.arch == "gemma4" and bool(meta.arch_get(
                BIDIRECTIONAL_VISION_KEY, llama_cpp_bidirectional_vision(int(meta.require("embedding_length"))))),
            architecture=meta.arch,
        )

    @classmethod
    def from_hf(cls, cfg: dict) -> "Gemma4Config":
        """From a transformers ``config.json`` dict (``text_config`` of a multimodal checkpoint, or
        the text config itself).

        Raises:
            ValueError: a required key is missing.
        """
        c = cfg.get("text_config", cfg)
        need = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads")
        missing = [k for k in need if k not in c]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        rope = c.get("rope_parameters") or {}
        full_rope = rope.get("full_attention") or {}
        slide_rope = rope.get("sliding_attention") or {}
        types = tuple("full" if t == "full_attention" else "sliding" for t in (c.get("layer_types") or ()))
        eos = c.get("eos_token_id", 1)
        global_head_dim = c.get("global_head_dim", 512)
        global_kv = c.get("num_global_key_value_heads")
        # transformers >= 5.2x saves full-layer shapes as per-layer overrides instead
        for idx, over in (c.get("per_layer_config") or {}).items():
            if types and types[int(idx)] == "full" and isinstance(over, dict):
                global_head_dim = over.get("head_dim", global_head_dim)
                global_kv = over.get("num_key_value_heads", global_kv)
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
            intermediate_size=c["intermediate_size"], num_heads=c["num_attention_heads"],
            num_kv_heads=c["num_key_value_heads"], head_dim=c.get("head_dim", 256),
            global_head_dim=global_head_dim, num_global_kv_heads=global_kv,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), context_length=c.get("max_position_embeddings", 131072),
            sliding_window=c.get("sliding_window", 512),
            rope_theta_local=slide_rope.get("rope_theta", 10_000.0),
            rope_theta_global=full_rope.get("rope_theta", 1_000_000.0),
            partial_rotary_factor=full_rope.get("partial_rotary_factor", 0.25),
            final_logit_softcapping=c.get("final_logit_softcapping"), layer_types=types,
            hidden_size_per_layer_input=c.get("hidden_size_per_layer_input") or 0,
            vocab_size_per_layer_input=c.get("vocab_size_per_layer_input") or 0,
            attention_k_eq_v=bool(c.get("attention_k_eq_v", False)),
            num_kv_shared_layers=c.get("num_kv_shared_layers", 0) or 0,
            use_double_wide_mlp=bool(c.get("use_double_wide_mlp", False)),
            enable_moe_block=bool(c.get("enable_moe_block", False)), num_experts=c.get("num_experts") or 0,
            top_k_experts=c.get("top_k_experts") or 0, moe_intermediate_size=c.get("moe_intermediate_size") or 0,
            bos_token_id=c.get("bos_token_id", 2), eos_token_id=eos[0] if isinstance(eos, list) else eos,
            pad_token_id=c.get("pad_token_id") or 0,
            bidirectional_vision=c.get("use_bidirectional_attention") == "vision",
        )


@dataclass(frozen=True)
class Gemma4AssistantConfig:
    """A Gemma 4 assistant (MTP drafter): its own small text model plus what ties it to a target
    (transformers ``Gemma4AssistantConfig``; GGUF arch ``gemma4-assistant``).

    Attributes:
        text: the assistant's layers (all query-only: every layer reads the target's KV cache).
        backbone_hidden_size: the target's width (``embedding_length_out`` in GGUF).
        num_centroids, centroid_top_k: the clustered head (``use_ordered_embeddings``); 0 = full head.
        draft_vocab_size: rows of a reduced-vocabulary head (gemmaspec's trained assistants: the
            target's most frequent tokens, mapped back to target ids by the ``draft_token_map``
            tensor); 0 = the head covers the whole vocabulary (``text.vocab_size`` is always the
            target's vocabulary).
    """

    text: Gemma4Config
    backbone_hidden_size: int
    num_centroids: int = 0
    centroid_top_k: int = 0
    draft_vocab_size: int = 0
    architecture: str = "gemma4-assistant"

    @property
    def clustered(self) -> tuple[int, int] | None:
        """``(num_centroids, top_k)`` when the clustered head is used, else None."""
        return (self.num_centroids, self.centroid_top_k) if self.num_centroids else None

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["text"] = json.loads(self.text.to_json())
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> "Gemma4AssistantConfig":
        data = json.loads(text)
        data["text"] = Gemma4Config.from_json(json.dumps(data["text"]))
        return cls(**data)

    @classmethod
    def from_gguf(cls, meta) -> "Gemma4AssistantConfig":
        """From a ``gemma4-assistant`` GGUF (``embedding_length_out``; ``num_centroids`` and
        ``centroid_top_k`` when the file keeps the clustered head's tensors).

        Raises:
            ModelFileError: a required key is missing.
        """
        text = Gemma4Config.from_gguf(meta)
        clustered = "masked_embd_ordering" in meta.tensor_shapes
        draft_vocab = 0
        if "draft_token_map" in meta.tensor_shapes:  # a reduced head: the target's vocabulary is a key
            draft_vocab = int(meta.tensor_shapes["draft_token_map"][0])
            text = dataclasses.replace(text, vocab_size=int(meta.require("target_vocab_size")))
        return cls(text=text, backbone_hidden_size=int(meta.require("embedding_length_out")),
                   num_centroids=int(meta.arch_get("num_centroids", 2048)) if clustered else 0,
                   centroid_top_k=int(meta.arch_get("centroid_top_k", 32)) if clustered else 0,
                   draft_vocab_size=draft_vocab)

    @classmethod
    def from_hf(cls, cfg: dict) -> "Gemma4AssistantConfig":
        """From an assistant checkpoint's ``config.json`` dict.

        Raises:
            ValueError: a required key is missing.
        """
        if "backbone_hidden_size" not in cfg:
            raise ValueError("config.json lacks backbone_hidden_size")
        text = Gemma4Config.from_hf(cfg.get("text_config") or {})
        ordered = bool(cfg.get("use_ordered_embeddings"))
        return cls(text=text, backbone_hidden_size=int(cfg["backbone_hidden_size"]),
                   num_centroids=int(cfg.get("num_centroids", 2048)) if ordered else 0,
                   centroid_top_k=int(cfg.get("centroid_intermediate_top_k", 32)) if ordered else 0)
