"""Calibrate the needle probe's positive control: continue a d128 comparison model on pass-key documents and
probe it as it trains.

The study's control (``controls.needle`` in studies/full.yaml) must retrieve at least half of its keys greedily,
or claim (d) reads "probe blind". This script finds the recipe: it trains the study's control (the same
documents, window, batch and schedule as ``stemlm.study.controls``) from ``--parent`` with checkpoints every
``--probe-every`` steps, then runs the needle probe on each checkpoint (greedy retrieval, the key − decoy margin,
the needle's gain) and, for each checkpoint, the mean log-probability of the key's first token and of its later
tokens (a 5-digit key is 5 tokens: finding it and copying it are different skills). Results go to ``--out``
(JSON), so the docs' numbers are in ``results/``.

    python benchmarks/needle_control.py --parent runs/study/full/runs/compare-d128-dense-seed0-... \\
        --key token-number --steps 1500 --lr 3e-3 --out results/study/needle-control/token-number-lr3e-3.json
    python benchmarks/needle_control.py --probe-only runs/needle-control/token-number-lr0.003-steps1500 \
        --key token-number --out ...
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from stemlm.runtime.files import atomic_write_text
from stemlm.study.probes import KEY_KINDS
from stemlm.version import git_commit

D128 = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=344",
        "model.ffn=dense"]


def train(args, data: Path) -> Path:
    """The control run, checkpointed every ``--probe-every`` steps; its run dir."""
    from stemlm.train import Trainer, load_train_config

    out = Path(args.work) / f"{args.key}-lr{args.lr:g}-steps{args.steps}"
    ov = [f"data.dir={data}", f"run.out={out}", f"run.steps={args.steps}", "data.batch_size=4",
          f"data.seq_len={args.seq_len}", *D128, f"model.max_seq_len={args.seq_len}", "run.stage=context_extend",
          f"run.init_from={args.parent}", "data.doc_masking=true", f"optim.lr={args.lr}", f"optim.table_lr={args.lr}",
          "run.eval_every=0", f"run.ckpt_every={args.probe_every}", "run.keep_last=100", "run.log_every=100",
          "run.progress=false", "run.plots=false", f"run.seed={args.seed}", f"data.seed={args.seed}"]
    trainer = Trainer(load_train_config("tiny", None, ov))
    trainer.fit()
    trainer.close()
    return out


def token_split(model, lm, items) -> dict:
    """Mean log-prob of the key's first token and of its later tokens, given the needle and the decoy."""
    from stemlm.eval.tasks.needle import QUESTION

    first, later = [], []
    for it in items:
        ctx = lm.tokens.encode(it["both"] + QUESTION)
        cont = lm.tokens.encode(it["both"] + QUESTION + f" {it['key']}")[len(ctx):]
        ids = torch.tensor([ctx + cont])[:, -(lm.max_length + 1):]
        with torch.no_grad():
            lp = model(ids[:, :-1]).log_softmax(-1)[0, -len(cont):]  # (len(cont), V)
        got = lp.gather(-1, torch.tensor(cont)[:, None])[:, 0].tolist()
        first.append(got[0])
        later += got[1:]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"first_token": mean(first), "later_tokens": mean(later), "n_later": len(later)}


def probe(run_dir: Path, data: Path, args) -> list[dict]:
    """The needle probe on every checkpoint of ``run_dir``."""
    from stemlm.eval.tasks.needle import needle_trials
    from stemlm.store import Placement, open_model
    from stemlm.study.probes import DECOY, decoy_items, key_drawer, lm_for, needle_probe, needle_values

    values = needle_values(args.key, data / "tokenizer.json")
    rows = []
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        model = open_model(ckpt).eval()
        lm = lm_for(model, data, max_length=args.seq_len)
        p = needle_probe(lm, args.trials, 0, values=values)
        _, _, items = needle_trials(lm, 1, 0, extra=DECOY.format(key=12345), draw_key=key_drawer(values))
        split = token_split(model, lm, decoy_items(items, 0, values))
        step = int(ckpt.name.split("_")[1])
        rows.append({"step": step, "retrieved": p["retrieved"], "margin": p["mean_margin"], "gain": p["mean_gain"],
                     "retrieval_by_length": {str(n): sum(r[j] for r in p["retrieval"]) / len(p["retrieval"])
                                             for j, n in enumerate(p["lengths"])}, **split})
        print(f"step {step}: greedy retrieval {p['retrieved']['mean']:.0%} of {p['retrieved']['n']}, margin "
              f"{p['mean_margin']['mean']:+.2f}, gain {p['mean_gain']['mean']:+.2f}, first token "
              f"{split['first_token']:.2f}, later tokens {split['later_tokens'] if split['later_tokens'] is None else round(split['later_tokens'], 2)}",
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parent", help="the d128 comparison run to continue (a run dir)")
    ap.add_argument("--key", default="token-number", choices=tuple(KEY_KINDS),
                    help="the probe's key kind (default token-number)")
    ap.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak lr, cosine (default 3e-3)")
    ap.add_argument("--seq-len", type=int, default=512, help="window (default 512)")
    ap.add_argument("--probe-every", type=int, default=500, help="checkpoint and probe every N steps (default 500)")
    ap.add_argument("--trials", type=int, default=2, help="needle trials per depth x length cell (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the continued run (default 0)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--work", default="runs/needle-control", help="run dirs (default runs/needle-control)")
    ap.add_argument("--probe-only", type=Path, help="probe the checkpoints of this run dir, train nothing")
    ap.add_argument("--out", type=Path, required=True, help="results JSON")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from stemlm.study.controls import control_corpus

    t0 = time.perf_counter()
    data = control_corpus({"control": "passkey", "seq_len": args.seq_len, "key": args.key}, None,
                          Path(args.work) / "data")
    if args.probe_only is None and not args.parent:
        raise SystemExit("--parent (a d128 comparison run dir) is needed unless --probe-only is given")
    run_dir = args.probe_only or train(args, data)
    rows = probe(run_dir, data, args)
    out = {"benchmark": "needle_control", "key": args.key, "steps": args.steps, "lr": args.lr, "seq_len": args.seq_len,
           "parent": str(args.parent), "run_dir": str(run_dir), "trials_per_cell": args.trials, "checkpoints": rows,
           "wall_s": time.perf_counter() - t0, "git_commit": git_commit()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
