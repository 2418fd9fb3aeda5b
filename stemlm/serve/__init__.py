"""``stemlm serve``: an OpenAI-compatible HTTP server over a continuous-batching engine.

``engine`` (the scheduler thread that owns the model), ``batch`` (the running batch and how
newcomers' KV caches join it), ``api`` (request schemas, validation, response bodies), ``chat``
(chat templates), ``metrics`` and ``app`` (the FastAPI layer). Only ``app`` needs FastAPI; nothing
here is imported by ``import stemlm``.
"""
