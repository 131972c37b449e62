"""``gemmaspec serve``: an OpenAI-compatible HTTP server (a drop-in for llama-server's API) with
continuous batching over several slots and speculative decoding. See ``docs/server.md``.

- :mod:`.scheduler`: the thread that owns the model and batches the slots' rounds;
- :mod:`.api`: ``create_app``, the FastAPI app put together; :mod:`.config`: ``ServeConfig``;
  :mod:`.state`: the typed server state and loading the model; :mod:`.deps`: the API key check and
  the routes' other dependencies;
- :mod:`.openai_routes` (``/v1/...``) and :mod:`.llama_routes` (``/completion``, ``/tokenize``,
  ``/slots``, ``/props``, ``/health``, ``/metrics``...): the endpoints; :mod:`.jobs`: submitting a
  request's generations to the scheduler and streaming or collecting their events;
- :mod:`.parse`: request bodies and their checks; :mod:`.translate`: a request's meaning for the
  engine (sampling settings, prompt ids, grammar, chat messages); :mod:`.responses`: response objects
  and streamed chunks; :mod:`.apierror`: the error answer;
- :mod:`.security` (Host / Origin / body checks), :mod:`.slots` (slot save / restore), :mod:`.tools`
  (tool calls), :mod:`.metrics` (Prometheus counters);
- :mod:`.main`: the command's flags and startup; ``static/``: the chat page at ``/`` (its files under ``/static/``).
"""
