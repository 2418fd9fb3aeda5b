"""Serve a checkpoint over an OpenAI-compatible HTTP API, with continuous batching.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming by server-sent events),
GET /v1/models, GET /health, GET /metrics, and /tokenize, /detokenize, /tokenizer_info (for
lm-eval's local-completions). SIGINT/SIGTERM let in-flight requests finish, then exit. Needs the
`serve` extra (pip install 'stemlm[serve]'). See docs/serving.md. Examples:

  stemlm serve --model runs/default
  stemlm serve --model CKPT --tier disk --cache-rows 4096 --max-batch 32 --port 8080
  stemlm serve --model CKPT --chat-template template.jinja --model-name my-model
"""

from __future__ import annotations

import sys
from pathlib import Path

from .options import add_table_dtype_argument, non_negative_int, positive_int

DEFAULT_RUN = "runs/default"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None,
                        help=f"checkpoint directory or training run directory (default: {DEFAULT_RUN} if it has been trained)")
    parser.add_argument("--tier", choices=("device", "host", "disk"), default="device",
                        help="where the STEM tables live: model memory, host RAM, or the checkpoint file on disk")
    parser.add_argument("--cache-rows", type=non_negative_int, default=0, help="hot-row cache size per table (host/disk tiers)")
    add_table_dtype_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=positive_int, default=8000, help="TCP port to listen on")
    parser.add_argument("--max-batch", type=positive_int, default=16, help="requests decoded together at most")
    parser.add_argument("--model-name", default=None,
                        help="name clients use in the `model` field (default: the checkpoint's directory name)")
    parser.add_argument("--chat-template", default=None,
                        help="jinja chat template file (default: the checkpoint's own, if it has one)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer file or directory (default: the checkpoint's or its run's)")
    parser.add_argument("--device", default="cpu", help="compute device: cpu | cuda | cuda:N | auto")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                        help="uvicorn's log level")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip checking the checkpoint's files against its checksum manifest (default: check)")


def run(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print("stemlm serve: error: the server needs FastAPI and uvicorn: pip install 'stemlm[serve]'", file=sys.stderr)
        return 2
    from ..runtime.devices import resolve_device
    from ..serve.server import load_served, serve_forever

    model = args.model
    if model is None:
        if not (Path(DEFAULT_RUN) / "checkpoints").is_dir():
            raise FileNotFoundError(f"no --model given and no trained default run at {DEFAULT_RUN} "
                                    "(train one with `stemlm train`, or pass --model CKPT)")
        model = DEFAULT_RUN
    served = load_served(model, tier=args.tier, cache_rows=args.cache_rows, device=str(resolve_device(args.device)),
                         max_batch=args.max_batch, model_name=args.model_name, chat_template=args.chat_template,
                         tokenizer=args.tokenizer, verify=not args.no_verify, table_dtype=args.table_dtype)
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
