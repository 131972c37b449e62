"""``gemmaspec serve``: an OpenAI-compatible HTTP server (a drop-in for llama-server's API) with
continuous batching over several slots and speculative decoding. See ``docs/server.md``.

- :mod:`.scheduler`: the thread that owns the model and batches the slots' rounds;
- :mod:`.api`: the FastAPI app (endpoints, request checks, OpenAI response shapes);
- :mod:`.metrics`: Prometheus counters;
- :mod:`.main`: the command's flags and startup; ``static/index.html``: the chat page at ``/``.
"""
