"""Knowledge-edit experiments: train small STEM models, then measure swaps, injection and removal.

Each run in ``RUNS`` is trained with ``stemlm train`` (skipped when its final checkpoint exists)
on the default corpus (or the facts-only corpus for ``data="facts"``), then evaluated with the
library (``stemlm.edit``) on held-out phrasings (``heldout_template``) and on trained phrasings
(``train``): swap success per layer set, probability shift, locality, reversibility; injection
of known countries into held-out countries and unused tokens; removal with neutral rows.

    python benchmarks/bench_edit.py                 # every run -> benchmarks/results/edit_eval.json
    python benchmarks/bench_edit.py --runs a,b      # a subset (merged into the results file)
    python benchmarks/bench_edit.py --quick         # 30-step smoke run -> edit_eval.quick.json

Each run's entry records the ``git_commit`` it was evaluated at (runs are merged into one file over
several invocations). Training runs use ``nice -n 10``. Runs live under ``runs/edit/`` (not in git).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from _train_bench import bench_work

from stemlm.runtime.files import atomic_write_text
from stemlm.version import git_commit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("STEMLM_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
RUN_DIR = bench_work(ROOT / "runs" / "edit")

# Shape: the debug preset (d_model 64, 4 layers, d_ff 128) with the corpus vocabulary; 2048 tokens/step.
SHAPES = {"facts": ["data.batch_size=32", "data.seq_len=64"], "r16": ["data.batch_size=16", "data.seq_len=128"],
          "default": ["data.batch_size=16", "data.seq_len=128"]}
BASE = ["model.vocab_size=4096", "run.progress=False", "run.plots=False"]
TLR1 = ["optim.table_lr=0.003"]  # = the backbone's peak lr (the default is 10x since TABLE_LR_SCALE)
TLR30 = ["optim.table_lr=0.1"]  # 33x the backbone's peak lr of 3e-3
TLR100 = ["optim.table_lr=0.3"]  # 100x
TLR333 = ["optim.table_lr=1.0"]  # 333x
DENSE = ["optim.table_optimizer=dense"]
EMB0 = ["optim.embed_lr=0"]  # input embedding frozen at its initialisation
SWEEP = dict(swaps_only=True, heldout_pairs=160)  # few held-out phrasings are known: 4x the pairs
RUNS: dict[str, dict] = {
    # name: stem layers, extra overrides, steps, data: "facts" (templated training facts only),
    # "r16" (the default corpus with every training fact repeated 16 times instead of 4), "default"
    "facts_full_tlr1": dict(stem="full", steps=600, over=TLR1, data="facts"),
    "facts_full_tlr30": dict(stem="full", steps=600, over=TLR30, data="facts"),
    "facts_all4_tlr30": dict(stem="0,1,2,3", steps=600, over=TLR30, data="facts"),
    "r16_all4_tlr30": dict(stem="0,1,2,3", steps=600, over=TLR30, data="r16"),
    # torch AdamW on whole tables (as the official code and as the embedding) instead of row-sparse AdamW
    "facts_full_dense": dict(stem="full", steps=600, over=TLR1 + DENSE, data="facts"),
    "facts_all4_dense": dict(stem="0,1,2,3", steps=600, over=TLR1 + DENSE, data="facts"),
    # plain Adam as in a minimal loop: beta2 0.999, no clipping, no weight decay, constant lr
    "facts_all4_tlr30_adam": dict(stem="0,1,2,3", steps=600, data="facts", over=TLR30 + [
        "optim.betas=[0.9,0.999]", "optim.grad_clip=0", "optim.weight_decay=0", "optim.min_lr_ratio=1.0",
        "optim.warmup_ratio=0"]),
    # sweep toward >= 90 % swap success (SWEEP: all table layers only, no injection / removal)
    "facts_all4_tlr100": dict(stem="0,1,2,3", steps=600, over=TLR100, data="facts", **SWEEP),
    "facts_all4_tlr333": dict(stem="0,1,2,3", steps=600, over=TLR333, data="facts", **SWEEP),
    "facts_full_tlr100": dict(stem="full", steps=600, over=TLR100, data="facts", **SWEEP),
    # input-embedding lr: 0.1x the backbone's, or 0 = frozen at its random init
    "facts_all4_tlr30_emb01": dict(stem="0,1,2,3", steps=600, over=TLR30 + ["optim.embed_lr=0.0003"], data="facts",
                                   **SWEEP),
    "facts_all4_tlr30_emb0": dict(stem="0,1,2,3", steps=600, over=TLR30 + EMB0, data="facts", **SWEEP),
    "facts_full_tlr30_emb0": dict(stem="full", steps=600, over=TLR30 + EMB0, data="facts", **SWEEP),
    # every embedding row the same (frozen) vector: token identity enters only through the tables
    "facts_all4_tlr30_embconst": dict(stem="0,1,2,3", steps=600, over=TLR30 + EMB0, data="facts", init="const_embed",
                                      **SWEEP),
    "facts_all4_tlr10_embconst": dict(stem="0,1,2,3", steps=600, over=["optim.table_lr=0.03"] + EMB0, data="facts",
                                      init="const_embed", **SWEEP),
    "facts_all4_tlr1_embconst": dict(stem="0,1,2,3", steps=600, over=TLR1 + EMB0, data="facts", init="const_embed",
                                     **SWEEP),
    # training length
    "facts_full_tlr30_emb0_s1200": dict(stem="full", steps=1200, over=TLR30 + EMB0, data="facts", **SWEEP),
    "facts_full_tlr30_emb0_s2000": dict(stem="full", steps=2000, over=TLR30 + EMB0, data="facts", heldout_pairs=160),
    "facts_all4_tlr30_embconst_s2000": dict(stem="0,1,2,3", steps=2000, over=TLR30 + EMB0, data="facts",
                                            init="const_embed", **SWEEP),
    # width: d_model 128, d_ff 256 (4x the debug model's parameters per layer)
    "facts_full_tlr30_emb0_w128": dict(stem="full", steps=600, data="facts", **SWEEP,
                                       over=TLR30 + EMB0 + ["model.d_model=128", "model.d_ff=256"]),
    # the default corpus (Wikipedia prose + facts, each training fact 16x): frozen embedding or not
    "r16_full_tlr30_emb0_s4000": dict(stem="full", steps=4000, over=TLR30 + EMB0, data="r16", heldout_pairs=160),
    "r16_full_tlr30_s4000": dict(stem="full", steps=4000, over=TLR30, data="r16", **SWEEP),
    # the default corpus exactly as `stemlm data prepare` builds it (each training fact 4x)
    "default_full_tlr30_emb0_s4000": dict(stem="full", steps=4000, over=TLR30 + EMB0, data="default",
                                          heldout_pairs=160),
    "default_full_tlr30_emb0_s10000": dict(stem="full", steps=10000, over=TLR30 + EMB0, data="default",
                                           heldout_pairs=160),
}
QUICK = {"quick": dict(stem="full", steps=30, over=[], data="default")}
# Made-up country names: several tokens each, pieces shared with real words.
MADE_UP = ["Zorvania", "Kelmoria", "Ostravia", "Brunavia", "Talmeria", "Quintaro", "Velloria", "Dramonia"]


def facts_corpus() -> Path:
    """The templated training facts alone as a corpus (default tokenizer), built once."""
    from stemlm.data import default_data_dir, load_facts, prepare_corpus, prepare_default_corpus
    from stemlm.data.facts import fact_documents

    default = prepare_default_corpus(progress=False)
    out = RUN_DIR / "data_facts"
    src = RUN_DIR / "facts_docs.jsonl"
    if not (out / "COMPLETE").exists():
        src.parent.mkdir(parents=True, exist_ok=True)
        docs = fact_documents(load_facts(default_data_dir()), repeats=4, seed=0)
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return prepare_corpus([src], out, tokenizer=default / "tokenizer.json", progress=False)


def corpus(kind: str) -> Path:
    """Data dir of a run: the default corpus, the default corpus with every training fact
    repeated 16 times instead of 4 (same prose, same facts file), or the facts alone."""
    from stemlm.data import prepare_default_corpus

    if kind == "facts":
        return facts_corpus()
    if kind == "r16":
        return prepare_default_corpus(RUN_DIR / "data_r16", fact_repeats=16, progress=False)
    return prepare_default_corpus(progress=False)


def const_embed_init(name: str, spec: dict) -> Path:
    """A fresh model of the run's shape (seed 0) whose input-embedding rows all equal row 0, saved
    as the run's ``run.init_from``: with ``optim.embed_lr=0`` the embedding then carries no token
    identity and every token-specific signal enters through the STEM tables."""
    from stemlm.checkpoint.directory import save_model
    from stemlm.model.decoder import StemLM
    from stemlm.train import load_train_config

    out = RUN_DIR / f"{name}_init"
    if (out / "config.json").exists():
        return out
    model_over = [o for o in spec["over"] if o.startswith("model.")]
    cfg = load_train_config("debug", None, [*BASE, f"model.stem_layers={spec['stem']}", *model_over])
    torch.manual_seed(cfg.run.seed)
    model = StemLM(cfg.model.build())
    with torch.no_grad():
        model.tok_embeddings.weight.copy_(model.tok_embeddings.weight[0].expand_as(model.tok_embeddings.weight))
    return save_model(model, out)


def train(name: str, spec: dict) -> Path:
    """Train one run with the CLI unless its final checkpoint exists; returns the run dir."""
    out = RUN_DIR / name
    final = out / "checkpoints" / f"step_{spec['steps']:08d}"
    if (final / "config.json").exists():
        return out
    data = corpus(spec["data"])
    init = [f"run.init_from={const_embed_init(name, spec)}"] if spec.get("init") == "const_embed" else []
    cmd = ["nice", "-n", "10", sys.executable, "-m", "stemlm", "train", "--preset", "debug", "--stem-layers",
           spec["stem"], "--steps", str(spec["steps"]), "--out", str(out), *BASE, *SHAPES[spec["data"]],
           *spec["over"], *init,
           f"run.ckpt_every={spec['steps']}", f"run.eval_every={spec['steps']}", "--data", str(data)]
    if out.exists():
        cmd.append("--resume")
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    print(f"  trained {name} in {time.time() - t0:.0f}s", flush=True)
    return out


def evaluate(run: Path, data: Path, n_pairs: int, quick: bool, swaps_only: bool = False,
             heldout_pairs: int | None = None) -> dict:
    """Swap / injection / removal metrics of a run's newest checkpoint (``data``: its corpus).

    ``swaps_only`` (sweep runs) edits all table layers only (no layer sweep) and stops after the
    swaps and the embedding diagnostic; ``heldout_pairs`` (default ``n_pairs``) country pairs are
    swapped on held-out phrasings, ``n_pairs * 3 // 4`` on trained phrasings."""
    import numpy as np

    from stemlm.data.facts import load_countries
    from stemlm.edit import entity_ids
    from stemlm.edit.evaluate import EditEvalConfig, EditEvaluator, layer_sweep, run_edit_eval
    from stemlm.edit.inject_eval import run_forget, run_injection, unused_tokens
    from stemlm.edit.load import load_model_and_tokenizer

    from stemlm.data import default_data_dir, load_facts

    facts_dir = data if (data / "facts" / "facts.jsonl").exists() else default_data_dir()  # facts-only corpus
    facts = load_facts(facts_dir)
    model, tok = load_model_and_tokenizer(run, data)
    out = {"summary": json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else None}
    sweep = {"all": None} if swaps_only else layer_sweep(model)
    held_pairs = heldout_pairs or n_pairs
    for split, pairs, sets in (("heldout_template", held_pairs, sweep), ("train", n_pairs * 3 // 4, {"all": None})):
        cfg = EditEvalConfig(split=split, n_pairs=pairs, layer_sets=sets)
        out[f"swap_{split}"] = run_edit_eval(model, tok, facts, cfg, progress=False)
    from stemlm.analyze.text import token_stream, windows

    stream, _ = token_stream(default_data_dir(), tok)  # unrelated prose: the validation passages
    text = torch.from_numpy(windows(stream, 128, 4))  # (4, 128)
    # diagnostic: the input embedding's share of the entity (not a STEM edit)
    for split, pairs in (("heldout_template", held_pairs), ("train", n_pairs * 3 // 4)):
        cfg = EditEvalConfig(split=split, n_pairs=pairs, layer_sets={"tables+emb": None, "emb_only": []}, embedding=True)
        out[f"diag_embedding_{split}"] = run_edit_eval(model, tok, facts, cfg, progress=False)
    if swaps_only:
        return out
    ev = EditEvaluator(model, tok, facts, EditEvalConfig(split="train", n_pairs=1), text=text)
    vocab = model.cfg.vocab_size
    meta = json.loads((facts_dir / "meta.json").read_text())
    held = {c: entity_ids(tok, c, vocab) for c in meta.get("heldout_countries", [])}
    unused = {f"unused:{tok.decode([t])}": [t] for t in
              unused_tokens(np.load(data / "train.counts.npy"), tok, 4 if quick else 16)}
    made_up = {n: entity_ids(tok, n, vocab) for n in MADE_UP}
    jobs = [("inject_heldout_country", held, "auto", "left"), ("inject_unused_token", unused, "auto", "left")]
    jobs += [(f"inject_made_up_{s}_{a}", made_up, s, a) for s, a in
             (("filler", "left"), ("filler", "right"), ("clone", "left"), ("average", "left"))]
    for key, entities, strategy, align in jobs:
        try:
            out[key] = run_injection(ev, entities, strategy=strategy, align=align)
        except ValueError as e:  # e.g. the model knows no fact yet (quick runs)
            out[key] = {"error": str(e), "success": None}
    known = sorted(c for c in ev.probes if any(ev.known[(p.country, p.key)][0] for p in ev.probes[c]))
    known = known[:: max(1, len(known) // n_pairs)][:n_pairs]
    country_ids = sorted({i for c in load_countries() for i in entity_ids(tok, c.name, vocab)})
    for key, repl in (("forget_mean", "mean"), ("forget_countries_mean", country_ids), ("forget_zero", "zero")):
        out[key] = run_forget(ev, known, replacement=repl)
    return out


def headline(name: str, res: dict) -> str:
    """One line per run: swap success on held-out and trained phrasings, locality, undo."""
    def pick(split):
        return next(r for r in res[f"swap_{split}"]["runs"] if r["layers_label"] == "all")
    h, t = pick("heldout_template"), pick("train")
    pct = lambda x: "  -  " if x is None else f"{100 * x:5.1f}"  # noqa: E731
    inj = res.get("inject_heldout_country", {"success": None})
    forget = res.get("forget_mean", {"success": None})
    return (f"{name:<18} known {h['known']:>4}/{t['known']:>4}  swap% heldout {pct(h['success'])} train "
            f"{pct(t['success'])}  loc% {pct(h['locality_top1'])}  undo% {pct(h['reversible'])}  "
            f"inject% {pct(inj['success'])}  forget% {pct(forget['success'])}")


def plot_levers(results: dict, path: Path) -> Path:
    """Swap success on held-out and on trained phrasings for every run (in ``RUNS`` order), as
    horizontal bars with the number of known cases, and the 90 % goal."""
    from stemlm.runtime.plotting import pyplot, save

    plt = pyplot()

    names = [n for n in RUNS if n in results] + [n for n in results if n not in RUNS]
    fig, ax = plt.subplots(figsize=(9, 0.38 * len(names) + 1.2))
    for i, name in enumerate(names):
        for j, (split, colour) in enumerate((("heldout_template", "tab:orange"), ("train", "tab:blue"))):
            run = next(r for r in results[name][f"swap_{split}"]["runs"] if r["layers_label"] == "all")
            y, value = i + (0.2 if j else -0.2), 100 * (run["success"] or 0)
            label = ("held-out phrasing", "trained phrasing")[j] if i == 0 else None
            ax.barh(y, value, height=0.38, color=colour, label=label)
            ax.text(value + 1, y, f"{value:.0f} % (n={run['known']})", va="center", fontsize=7)
    ax.axvline(90, color="k", ls="--", lw=0.8, label="goal 90 %")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 125)
    ax.set_xlabel("swap success, all table layers edited (%)")
    ax.set_title("What moves swap success (debug shape, row swaps of two countries)", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    save(fig, path, dpi=110)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="30-step smoke run; writes edit_eval.quick.json")
    parser.add_argument("--runs", default=None, help="comma list of run names (default: all)")
    parser.add_argument("--pairs", type=int, default=40, help="country pairs per swap evaluation")
    parser.add_argument("--replot", action="store_true", help="only redraw edit_levers.png from edit_eval.json")
    args = parser.parse_args()
    if args.replot:
        results = json.loads((RESULTS / "edit_eval.json").read_text())
        print(f"wrote {plot_levers(results, RESULTS / 'edit_levers.png')}")
        return 0
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", max(1, min(2, os.cpu_count() or 1)))))
    runs = QUICK if args.quick else {k: v for k, v in RUNS.items() if args.runs is None or k in args.runs.split(",")}
    path = RESULTS / ("edit_eval.quick.json" if args.quick else "edit_eval.json")
    results = json.loads(path.read_text()) if path.exists() and not args.quick else {}
    for name, spec in runs.items():
        run = train(name, spec)
        t0 = time.time()
        res = evaluate(run, corpus(spec["data"]), 4 if args.quick else args.pairs, args.quick,
                       spec.get("swaps_only", False), None if args.quick else spec.get("heldout_pairs"))
        results[name] = {"spec": spec, "git_commit": git_commit(ROOT), "eval_seconds": round(time.time() - t0), **res}
        RESULTS.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(results, indent=1))
        print(headline(name, results[name]), flush=True)
    if not args.quick:
        print(f"wrote {plot_levers(results, RESULTS / 'edit_levers.png')}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
