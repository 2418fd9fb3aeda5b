"""``stemlm serve``: an OpenAI-compatible HTTP server over a continuous-batching engine.

``engine`` (the scheduler thread that owns the model), ``batch`` (the running batch and how
newcomers' KV caches join it), ``api`` (request schemas, validation, response bodies), ``chat``
(chat templates), ``responses`` (OpenAI response bodies and stream chunks), ``metrics``, ``app`` (the
FastAPI layer) and ``server`` (loading a checkpoint into an engine, running uvicorn). Only ``app`` and
``server`` need FastAPI; nothing here is imported by ``import stemlm``.
"""
