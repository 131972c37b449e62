"""Block-quantized weights and the CPU kernels that multiply by them.

A :class:`StoredWeight` keeps a weight matrix W [N, K] as the GGUF file's blocks, byte for byte
(Q4_0, Q8_0, Q5_0, Q4_K, Q6_K: :data:`STORED_TYPES`; the bytes may view a memory-mapped file). A
:class:`QuantizedWeight` holds W as int8 values ``q`` [N, K], an fp32 ``scale`` [N, K/G] and an
optional fp32 ``offset`` [N, K/G] (G = 16 or 32 values per block), so that
``W[n, k] = scale[n, k // G] * q[n, k] + offset[n, k // G]``; every GGML block type converts to this
form without rounding (:mod:`gemmaspec.kernels.ggml_blocks`), which is how the types without a stored
kernel (Q4_1, Q5_1, Q5_K) are held. Both multiply with the same bits for the same weights. A
:class:`StackedWeight` puts several of them side by side (q, k, v) for one kernel call. All are
:class:`BlockWeight` objects.

Products with few rows (decode, speculative verify: M <= ``SMALL_M``) run in ``qmatmul.c``, a C
kernel compiled once per machine into the gemmaspec cache with the system C compiler (``cc``); it
reads the weights straight from memory and multiplies them with fp32 activations, or, in the
int8 mode of :func:`set_act_quant` (``--act-quant q8_0``; what ``auto`` picks for models whose decode
step reads >= 512 MiB), with activations quantized to int8 per 32 values (llama.cpp's scheme;
``qdot8.h``); in that mode prefill's products run there too. With fp32 activations larger products
(prefill) dequantize a tile of rows at a time into a reused fp32 buffer and use PyTorch's matmul. Without a C compiler, or with ``GEMMASPEC_NO_KERNELS=1``, every product uses the
dequantized fp32 matrix, kept in memory: correct, slower, four times the memory.

Where things live: :mod:`~gemmaspec.kernels.build` (the compiler, CPU features, the compiled library,
threads, the activation mode), :mod:`~gemmaspec.kernels.weights` (the CPU weight classes and their
products), :mod:`~gemmaspec.kernels.regroup` (the background regroup), :mod:`~gemmaspec.kernels.cuda`
(the GPU layout), :mod:`~gemmaspec.kernels.memory` (bytes of weights, KV cache and buffers on the CPU
and the GPU) and :mod:`~gemmaspec.kernels.ggml_blocks` (GGML blocks to int8 levels). This module
re-exports what callers use; module state (the activation mode, the thread count, the loaded library)
has one home each, in ``build``.
"""

from __future__ import annotations

from .base import BlockWeight
from .build import (ACT_QUANTS, AUTO_Q8_BYTES, AUTO_Q8_HEAD_BYTES, FMT_I8, FMT_I8X8, FMT_Q4_0R8, FMT_Q4_0X8,
                    FMT_Q8_0R8, FMT_Q8_0X8, ISAS, STORED_TYPES, _FMT, _R8, _R8_ISAS, _X8, _env_act_quant, act_quant,
                    auto_q8_head, auto_q8_layers, compiled_library, cpu_supports, draft_act_quant, isa_choice,
                    kernel_isa, load_library, matmul_library, ops_on_one_thread, resolve_act_quant, set_act_quant,
                    threads)
from .regroup import _bg_ready, regroup_in_background, sync_layouts
from .weights import (SMALL_M, TILE_BYTES, CPUBlockWeight, Q4_0Weight, QuantizedWeight, StackedWeight, StoredWeight,
                      device_weight)

__all__ = [
    "ACT_QUANTS", "AUTO_Q8_BYTES", "AUTO_Q8_HEAD_BYTES", "FMT_I8", "FMT_I8X8", "FMT_Q4_0R8", "FMT_Q4_0X8", "FMT_Q8_0R8",
    "FMT_Q8_0X8", "ISAS", "SMALL_M", "STORED_TYPES", "TILE_BYTES", "BlockWeight", "CPUBlockWeight", "Q4_0Weight",
    "QuantizedWeight", "StackedWeight", "StoredWeight", "act_quant", "auto_q8_head", "auto_q8_layers",
    "compiled_library", "cpu_supports", "device_weight", "draft_act_quant", "isa_choice", "kernel_isa", "load_library",
    "matmul_library", "ops_on_one_thread", "regroup_in_background", "resolve_act_quant", "set_act_quant",
    "sync_layouts", "threads",
]
