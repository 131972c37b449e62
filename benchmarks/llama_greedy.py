"""Runs inside the llama-cpp-python venv: teacher-forced logits of a token sequence.

Args (JSON): model, tokens (ids, BOS included), out (path for a float32 .npy of [len(tokens), vocab]
logits), prompt (text: its ids come back in the JSON line, to compare tokenizers).
"""

import json
import sys

import numpy as np
from llama_cpp import Llama

args = json.loads(sys.argv[1])
# float32 KV cache (llama.cpp's default is f16), so only the weights' own types differ between engines
llm = Llama(model_path=args["model"], n_threads=2, n_ctx=args.get("ctx", 512), verbose=False, seed=0,
            logits_all=True, type_k=0, type_v=0)
prompt_ids = llm.tokenize(args["prompt"].encode(), add_bos=True, special=True)
llm.eval(args["tokens"])
np.save(args["out"], np.array(llm.scores[: len(args["tokens"])], dtype=np.float32))
print(json.dumps({"prompt_ids": prompt_ids}))
