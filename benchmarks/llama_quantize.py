"""Runs inside the llama-cpp-python venv: llama.cpp's own quantizer (``llama_model_quantize``) writes an
all-Q4_0 copy of a GGUF, token embedding and output included (``pure``: every matrix Q4_0).

    python llama_quantize.py SRC.gguf OUT.gguf
"""

import sys

import llama_cpp

src, out = sys.argv[1], sys.argv[2]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
p.pure = True  # every 2-D weight Q4_0 (no Q6_K/Q8_0 "important" tensors)
p.allow_requantize = True  # the source is already quantized (Q4_K_M); llama.cpp dequantizes, then quantizes
p.token_embedding_type = 2  # GGML_TYPE_Q4_0
p.output_tensor_type = 2
p.nthread = 2
rc = llama_cpp.llama_model_quantize(src.encode(), out.encode(), p)
sys.exit(0 if rc == 0 else 1)
