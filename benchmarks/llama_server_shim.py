"""A ``llama-server`` stand-in: translates llama-server's command line into ``gemmaspec serve``'s and
runs it (``exec``), so llama.cpp's own server test suite can drive gemmaspec
(``benchmarks/llama_server_suite.py`` runs it).

Every model request (``--model``, ``--hf-repo``, ``--hf-file``, ``--model-url``) is served by
gemmaspec's default model (Gemma 3 270M): the suite's small test models (stories260K, tinygemma3...)
are not downloaded. Flags for things gemmaspec does not do exit at once with status 2 and a line on
stderr saying which (``--embedding``, ``--reranking``, ``--lora``, ``--mmproj-url``, router mode with
``--models-dir`` or without a model, ``--tools``, MCP servers), so those tests fail at start for a
stated reason; tuning flags with no gemmaspec meaning (batch sizes, GPU layers, flash attention,
``--jinja``...) are dropped; ``--slots``, ``--no-slots``, ``--no-ui``, ``--verbose``, ``--alias``,
``--tags`` are passed on, and so are ``--chat-template`` (a name gemmaspec knows, else dropped) and
``--chat-template-file`` (when the file exists; the runner extracts llama.cpp's ``models/templates``).
Without ``--metrics`` the shim passes ``--no-metrics`` (llama-server's ``/metrics`` is opt-in).
``--ctx-size`` is divided by ``--parallel`` (llama-server's context is shared by its slots,
gemmaspec's ``-c`` is per slot).

    python benchmarks/llama_server_shim.py --port 8080 --hf-repo ggml-org/models --ctx-size 512 ...
"""

from __future__ import annotations

import os
import sys

# llama-server flag -> gemmaspec serve flag (None: same name); each takes one value
VALUE = {"--port": None, "--host": None, "--temp": None, "--seed": None, "--alias": "-a", "-a": "-a",
         "--ctx-size": "-c", "-c": "-c", "--parallel": "-np", "-np": "-np", "--n-predict": "-n", "-n": "-n",
         "--threads": "-t", "-t": "-t", "--api-key": None, "--slot-save-path": None, "--spec-type": None,
         "--spec-draft-n-max": None, "--spec-draft-n-min": None, "--cors-origins": "--cors-origin",
         "--top-k": None, "--top-p": None, "--min-p": None, "--repeat-penalty": None,
         "--tags": None, "--chat-template": None, "--chat-template-file": None}
# flags taking a value that gemmaspec ignores (the model is always the default one)
DROP_VALUE = {"--model", "-m", "--hf-repo", "-hf", "--hf-file", "-hff", "--model-url", "--batch-size", "-b",
              "--ubatch-size", "-ub", "--n-gpu-layers", "-ngl", "-ctk", "-ctv", "-fa", "--grp-attn-n",
              "--grp-attn-w", "--reasoning-format", "--reasoning",
              "--pooling", "--model-draft", "--cache-ram", "--sleep-idle-seconds", "--media-path",
              "--tools-runtime", "--spec-synth-len", "--spec-synth-rates", "--cache-reuse-hybrid",
              "--cache-reuse-hybrid-min-share", "--log-file", "--models-max", "--models-preset"}
FLAG = {"--slots", "--no-slots", "--verbose", "--no-ui", "--context-shift"}  # passed on as they are
DROP_FLAG = {"--offline", "--cont-batching", "--metrics", "--kv-unified", "--swa-full",
             "--no-models-autoload", "--jinja", "--no-jinja",
             "--no-mmproj", "--no-cache-idle-slots", "--ui-mcp-proxy", "--backend_sampling"}
UNSUPPORTED = {"--embedding": "embeddings", "--embeddings": "embeddings", "--reranking": "reranking",
               "--lora": "LoRA adapters", "--mmproj-url": "images (multimodal projector)",
               "--models-dir": "router mode (several models)", "--tools": "built-in server tools",
               "--mcp-servers-config": "MCP servers", "--mcp-servers-json": "MCP servers"}


def refuse(message: str) -> None:
    print(f"llama-server shim: {message}", file=sys.stderr)
    sys.exit(2)


def translate(argv: list[str]) -> list[str]:
    """llama-server arguments -> ``gemmaspec serve`` arguments.

    Raises:
        SystemExit: status 2 for a flag gemmaspec does not support (named on stderr).
    """
    out, i, has_model = [], 0, False
    while i < len(argv):
        a = argv[i]
        if a in UNSUPPORTED:
            refuse(f"gemmaspec does not do {UNSUPPORTED[a]} ({a})")
        if a == "--chat-template" and argv[i + 1] not in ("gemma", "chatml", "llama3", "command-r") or \
                a == "--chat-template-file" and not os.path.exists(argv[i + 1]):
            i += 2
        elif a in VALUE:
            out += [VALUE[a] or a, argv[i + 1]]
            i += 2
        elif a in DROP_VALUE:
            has_model |= a in ("--model", "-m", "--hf-repo", "-hf", "--model-url")
            i += 2
        elif a in FLAG:
            out.append(a)
            i += 1
        elif a in DROP_FLAG:
            i += 1
        else:
            refuse(f"unknown llama-server flag {a}")
    if "--metrics" not in argv:  # llama-server's /metrics is off unless asked for; gemmaspec's is on
        out.append("--no-metrics")
    if not has_model:
        refuse(f"gemmaspec does not do {UNSUPPORTED['--models-dir']} (no model given)")
    # llama-server's --ctx-size is shared by its slots (each gets ctx / parallel, unless --kv-unified);
    # gemmaspec's -c is each slot's own
    if "-c" in out and "-np" in out and "--kv-unified" not in argv:
        at = out.index("-c") + 1
        out[at] = str(max(1, int(out[at]) // int(out[out.index("-np") + 1])))
    return out


def main() -> None:
    args = ["serve", *translate(sys.argv[1:])]
    os.execv(sys.executable, [sys.executable, "-m", "gemmaspec", *args])


if __name__ == "__main__":
    main()
