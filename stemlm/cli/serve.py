"""Serve a checkpoint over an OpenAI-compatible HTTP API, with continuous batching.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming by server-sent events),
GET /v1/models, GET /health, GET /metrics, and /tokenize, /detokenize, /tokenizer_info (for
lm-eval's local-completions). SIGINT/SIGTERM let in-flight requests finish, then exit. Needs the
`serve` extra (pip install 'stemlm[serve]'). See docs/serving.md. Examples:

  stemlm serve --ckpt runs/default
  stemlm serve --ckpt CKPT --tables disk --cache-rows 4096 --max-batch 32 --port 8080
  stemlm serve --ckpt CKPT --chat-template template.jinja --model-name my-model
  stemlm serve --ckpt CKPT --host 0.0.0.0 --api-key "$KEY" --max-prompt-tokens 2048 --request-timeout 120

--model is an alias of --ckpt (vLLM's name), --tier the deprecated old name of --tables.

Before exposing a server beyond this machine, set an API key (--api-key or STEMLM_API_KEY) and the
limits: bodies, prompt tokens and max_tokens over a limit get 413, a full queue 429, a request past
--request-timeout 504.
"""

from __future__ import annotations

import os
import sys

from ..checkpoint.rundir import RunDir
from .options import (add_checkpoint_argument, add_graphs_argument, add_placement_arguments, add_tokenizer_argument,
                      add_verify_argument, placement_from_args, positive_float, positive_int)

DEFAULT_RUN = "runs/default"


def add_arguments(parser) -> None:
    add_checkpoint_argument(parser, required=False, help=f"checkpoint directory or training run directory "
                                                         f"(default: {DEFAULT_RUN} if it has been trained)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=positive_int, default=8000, help="TCP port to listen on")
    parser.add_argument("--max-batch", type=positive_int, default=16, help="requests decoded together at most")
    parser.add_argument("--model-name", default=None,
                        help="name clients use in the `model` field (default: the checkpoint's directory name)")
    parser.add_argument("--chat-template", default=None,
                        help="jinja chat template file (default: the checkpoint's own, if it has one)")
    add_tokenizer_argument(parser)
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                        help="uvicorn's log level")
    add_verify_argument(parser)
    add_graphs_argument(parser)
    add_placement_arguments(parser, deprecated_tier=True)
    limits = parser.add_argument_group("limits (for a server others can reach)")
    limits.add_argument("--api-key", default=os.environ.get("STEMLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: the "
                             "STEMLM_API_KEY environment variable; unset = no key)")
    limits.add_argument("--max-body-bytes", type=positive_int, default=1 << 20,
                        help="largest request body in bytes; larger gets 413 (default 1048576)")
    limits.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                        help="longest prompt in tokens; longer gets 413 (default: the model's context)")
    limits.add_argument("--max-new-tokens", type=positive_int, default=None,
                        help="largest max_tokens a request may ask for; larger gets 413, and a request that "
                             "names none gets at most this many (default: the rest of the context)")
    limits.add_argument("--max-queue", type=positive_int, default=256,
                        help="prompts waiting for a batch slot at most; more get 429 (default 256)")
    limits.add_argument("--request-timeout", type=positive_float, default=None,
                        help="seconds a request may take from arrival to its last token; later gets 504 "
                             "(default: no limit)")


def run(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print("stemlm serve: error: the server needs FastAPI and uvicorn: pip install 'stemlm[serve]'", file=sys.stderr)
        return 2
    from ..serve.guard import Limits
    from ..serve.server import load_served, serve_forever

    ckpt = args.ckpt
    if ckpt is None:
        if not RunDir.holds_run(DEFAULT_RUN):
            raise FileNotFoundError(f"no --ckpt given and no trained default run at {DEFAULT_RUN} "
                                    "(train one with `stemlm train`, or pass --ckpt CKPT)")
        ckpt = DEFAULT_RUN
    served = load_served(ckpt, placement_from_args(args), max_batch=args.max_batch, model_name=args.model_name,
                         chat_template=args.chat_template, tokenizer=args.tokenizer, verify=args.verify,
                         limits=Limits(args.api_key or None, args.max_body_bytes, args.max_prompt_tokens,
                                       args.max_new_tokens, args.max_queue, args.request_timeout),
                         graphs=args.graphs)
    print(_banner(served.name, args.host, args.port, served.chat is not None), flush=True)
    serve_forever(served, args.host, args.port, args.log_level)
    print("stemlm serve: stopped after finishing the requests in flight", file=sys.stderr)
    return 0


def _banner(name: str, host: str, port: int, chat: bool) -> str:
    url = f"http://{host}:{port}"
    lines = [f"stemlm serve: serving {name!r} at {url}/v1 (Ctrl-C drains in-flight requests and stops)",
             "  try:",
             f"  curl {url}/v1/completions -H 'Content-Type: application/json' \\",
             f"       -d '{{\"model\": \"{name}\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16}}'",
             f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none'); "
             f"print(c.completions.create(model='{name}', prompt='Hello', max_tokens=16).choices[0].text)\""]
    if not chat:
        lines.append("  (this model has no chat template: /v1/chat/completions needs --chat-template FILE)")
    return "\n".join(lines)
