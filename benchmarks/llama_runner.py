"""Runs inside the llama-cpp-python venv: one greedy generation, timings as JSON on stderr.

Prints each token's text to stdout as it comes (so the parent can time the first token of a cold
process), then a JSON line on stderr: prompt tokens, prefill and decode tokens/s.
"""

import json
import sys
import time

t_start = time.perf_counter()
from llama_cpp import Llama  # noqa: E402

args = json.loads(sys.argv[1])
llm = Llama(model_path=args["model"], n_threads=args["threads"], n_threads_batch=args["threads"],
            n_ctx=args.get("ctx", 4096), verbose=False, seed=0)
t_loaded = time.perf_counter()
prompt_ids = llm.tokenize(args["prompt"].encode(), add_bos=True, special=True)
bias = {llm.token_eos(): -1e9}
eot = llm.tokenize(b"<end_of_turn>", add_bos=False, special=True)
if len(eot) == 1:
    bias[eot[0]] = -1e9
extra = {}
if args.get("draft") == "ngram":
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    llm.draft_model = LlamaPromptLookupDecoding(num_pred_tokens=args.get("n_max", 3))
t0 = time.perf_counter()
times = []
n = 0
for chunk in llm.create_completion(prompt_ids, max_tokens=args["n"], temperature=0.0, top_k=1, stream=True,
                                   logit_bias=bias, **extra):
    now = time.perf_counter()
    times.append(now)
    n += 1
    sys.stdout.write(chunk["choices"][0]["text"])
    sys.stdout.flush()
t_end = time.perf_counter()
ttft = times[0] - t0 if times else None
decode_tps = (n - 1) / (times[-1] - times[0]) if n > 1 else None
print(json.dumps({"prompt_tokens": len(prompt_ids), "generated": n, "load_s": t_loaded - t_start,
                  "ttft_ms": ttft * 1e3 if ttft else None,
                  "prefill_tps": len(prompt_ids) / ttft if ttft else None, "decode_tps": decode_tps}), file=sys.stderr)
