"""``stemlm serve``: an OpenAI-compatible HTTP server over a continuous-batching engine.

``engine`` (the scheduler thread that owns the model and drives ``stemlm.inference.core``'s decode
core), ``api`` (request schemas, validation), ``guard`` (API key, body and prompt limits), ``chat``
(chat templates), ``responses`` (OpenAI response bodies and stream chunks), ``metrics``, ``app`` (the
FastAPI layer) and ``server`` (opening a checkpoint into an engine, running uvicorn). Only ``app`` and
``server`` need FastAPI; nothing here is imported by ``import stemlm``.
"""
