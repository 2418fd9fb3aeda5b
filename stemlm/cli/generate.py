"""Generate text from a checkpoint, with the STEM tables on device, host RAM or disk.

The text streams to stdout as it is produced. `--ckpt` is a checkpoint directory or a training
run directory (its newest complete checkpoint is used); the tokenizer is taken from the checkpoint
directory unless `--tokenizer` is given. Examples:

  stemlm generate --ckpt runs/debug --prompt "The capital of France is" --max-new-tokens 20
  stemlm generate --ckpt CKPT --prompt "Hello" --tables disk --cache-rows 4096 --stats
  stemlm generate --ckpt CKPT --prompt "Once" --temperature 0.8 --top-k 50 --top-p 0.95 --seed 1
  stemlm generate --ckpt CKPT --prompt "Once" --prompt "The capital of" --max-new-tokens 20   # one batch
"""

from __future__ import annotations

import json
import sys
import time

from .options import (add_checkpoint_argument, add_graphs_argument, add_matmul_argument, add_placement_arguments,
                      add_tokenizer_argument, add_verify_argument, non_negative_float, non_negative_int, placement_from_args,
                      positive_int, probability)


def add_arguments(parser) -> None:
    add_checkpoint_argument(parser)
    parser.add_argument("--prompt", action="append", required=True,
                        help="text to continue; repeat it to generate several prompts as one batch, each printed on "
                             "its own line as it would be alone (same --seed for each)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate at most (default 64)")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    parser.add_argument("--top-k", type=positive_int, default=None, help="sample among the k most likely tokens")
    parser.add_argument("--top-p", type=probability, default=None, help="nucleus sampling: smallest set with probability >= p")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="random seed for sampling (default 0)")
    add_tokenizer_argument(parser)
    add_placement_arguments(parser)
    add_matmul_argument(parser)
    add_graphs_argument(parser)
    parser.add_argument("--stats", action="store_true", help="print speed and table traffic statistics to stderr")
    add_verify_argument(parser)


def run(args) -> int:
    from ..checkpoint.directory import resolve_checkpoint
    from ..inference.generate import check_sampling, generate
    from ..data.codec import load_codec
    from ..inference.text import encode_prompt, stream_text
    from ..runtime.matmul import apply_matmul
    from ..store import open_model

    placement = placement_from_args(args)
    device = placement.device
    check_sampling(args.temperature, args.top_k, args.top_p)
    ckpt = resolve_checkpoint(args.ckpt)
    codec = load_codec(ckpt, args.tokenizer)
    model = open_model(ckpt, placement, verify=args.verify)
    store = model.tables
    apply_matmul(model, args.matmul, device)
    if len(args.prompt) > 1:
        return _run_batch(args, model, store, codec, ckpt)
    prompt = encode_prompt(codec, args.prompt[0], model.cfg.vocab_size).to(device)
    new_tokens = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                          seed=args.seed, eos_id=codec.eos_id, graphs=args.graphs)  # checks everything before the prompt is echoed
    sys.stdout.write(args.prompt[0])
    sys.stdout.flush()
    n_tokens, start = 0, time.perf_counter()

    def tokens():
        nonlocal n_tokens
        for tok in new_tokens:
            n_tokens += 1
            yield int(tok[0])

    for piece in stream_text(codec, tokens()):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - start
    _report(args, store, ckpt, n_tokens, elapsed, prompt.shape[1])
    store.close()
    return 0


def _run_batch(args, model, store, codec, ckpt) -> int:
    """All prompts as one batch (``batch_generate``); each prompt and its continuation on a line."""
    from ..inference.batch_generate import SamplingParams, generate_batch
    from ..inference.text import encode_prompt

    prompts = [encode_prompt(codec, p, model.cfg.vocab_size)[0].tolist() for p in args.prompt]
    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    start = time.perf_counter()
    new = generate_batch(model, prompts, params, eos_id=codec.eos_id, graphs=args.graphs)
    elapsed = time.perf_counter() - start
    for text, ids in zip(args.prompt, new):
        sys.stdout.write(text + codec.decode(ids) + "\n")
    _report(args, store, ckpt, sum(map(len, new)), elapsed, sum(map(len, prompts)))
    store.close()
    return 0


def _report(args, store, ckpt, n_tokens: int, elapsed: float, prompt_tokens: int) -> None:
    """Speed and table traffic as JSON on stderr when ``--stats`` is given."""
    if args.stats:
        stats = {k: v for k, v in store.stats().items() if k != "per_table"}
        report = {"new_tokens": n_tokens, "seconds": round(elapsed, 4),
                  "tokens_per_s": round(n_tokens / elapsed, 2) if elapsed else None, "prompt_tokens": prompt_tokens,
                  "checkpoint": str(ckpt), **stats}
        print(json.dumps(report, indent=2), file=sys.stderr)
