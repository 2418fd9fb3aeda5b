"""Step 0 of inserting STEM into a pretrained model: held-out loss of each table initialisation.

SmolLM2-135M (the pinned GGUF) is converted to STEM (default: 1/3 of the layers) with every
initialisation in the grid, and each converted model's loss is measured on held-out prose the
calibration never saw (the validation split of the offline corpus in SmolLM2's tokenizer),
against the dense model on the same tokens. Calibration reads the training split.

    python benchmarks/bench_insertion.py                      # the default grid -> insertion_step0.json
    python benchmarks/bench_insertion.py --grid gated-seq,gated-seq-262k --eval-batches 31
    python benchmarks/bench_insertion.py --quick              # two settings, few tokens

Every setting is one streamed calibration pass (``stemlm.insert.calibrate``) and one evaluation;
results are merged into the JSON file as they finish (a setting already there with the same
evaluation is skipped), so an interrupted grid resumes. Each entry records the calibration
time, the ids seen and the share of held-out tokens whose id the calibration saw.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from _train_bench import bench_work

from stemlm.runtime.files import atomic_write_text
from stemlm.version import git_commit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("STEMLM_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
WORK = bench_work(ROOT / "runs" / "insertion")
K = 65_536
# name: (ffn, init, calibration settings)
GRID = {
    "zero": ("stem", "zero", {}),
    "project": ("stem", "project", {}),
    "mean-par": ("stem", "calibrate", {"method": "mean", "sequential": False, "tokens": K}),
    "gated-par": ("stem", "calibrate", {"method": "gated", "sequential": False, "tokens": K}),
    "gated-seq": ("stem", "calibrate", {"method": "gated", "tokens": K}),
    "gated-seq-refit": ("stem", "calibrate", {"method": "gated", "tokens": K, "refit_down": True}),
    "down-seq": ("stem", "calibrate", {"method": "down", "tokens": K}),
    "gated-seq-regress": ("stem", "calibrate", {"method": "gated", "tokens": K, "unseen": "regress"}),
    "gated-seq-262k": ("stem", "calibrate", {"method": "gated", "tokens": 4 * K}),
    "gated-seq-refit-262k": ("stem", "calibrate", {"method": "gated", "tokens": 4 * K, "refit_down": True}),
    "gated-seq-refit-regress-262k": ("stem", "calibrate", {"method": "gated", "tokens": 4 * K, "refit_down": True,
                                                           "unseen": "regress"}),
    "gated-seq-refit-1m": ("stem", "calibrate", {"method": "gated", "tokens": 16 * K, "refit_down": True}),
}
DEFAULT = ["zero", "project", "mean-par", "gated-par", "gated-seq", "gated-seq-refit", "gated-seq-262k",
           "gated-seq-refit-262k"]


def dense_and_data():
    """The all-dense stemlm copy of SmolLM2 (exact) and its corpus (train, val token streams)."""
    from stemlm.data import TokenDataset, corpus_in_vocabulary
    from stemlm.store import open_model
    from stemlm.interop.convert import convert_from_hf

    dense_dir = WORK / "smollm2-dense"
    if not (dense_dir / "config.json").exists():
        convert_from_hf("smollm2", dense_dir, ffn="dense")
    data = corpus_in_vocabulary(dense_dir / "tokenizer.json", progress=False)
    return open_model(dense_dir), TokenDataset.open(data, "train"), TokenDataset.open(data, "val")


def build(dense, train, name: str, layers: str):
    """The converted model of one grid setting, and what its calibration saw."""
    from stemlm.insert.calibrate import CalibrationConfig, assemble, calibrate, calibration_windows
    from stemlm.interop.convert import llama_config_to_stem_of, llama_state_to_stem, model_from_state
    from stemlm.interop.convert import llama_name

    ffn, init, settings = GRID[name]
    target = llama_config_to_stem_of(dense.cfg, ffn, layers)
    if init != "calibrate":  # project / zero: the converter's own init from the Llama-named weights
        llama_state = {llama_name(k): v for k, v in dense.state_dict().items()
                       if not (dense.cfg.tie_embeddings and k == "lm_head.weight")}
        return model_from_state(target, llama_state_to_stem(llama_state, target, init=init)), {}
    calib = CalibrationConfig(**settings)
    ids = calibration_windows(train.tokens, calib.tokens, calib.seq_len)
    work = WORK / "calib" / f"{name}-{layers.replace('/', '_')}"
    t0 = time.perf_counter()
    fitted = calibrate(dense, target, ids, calib, work, progress=True)
    seen = torch.zeros(dense.cfg.vocab_size, dtype=torch.bool)
    seen[ids.reshape(-1)] = True
    return assemble(dense, target, fitted), {"calib_seconds": time.perf_counter() - t0, "calib_tokens": ids.numel(),
                                             "ids_seen": int(seen.sum()), "seen": seen}


def held_out(model, val, batches: int) -> float:
    from stemlm.train.evaluate import evaluate

    return evaluate(model, val, 4, 256, batches)["loss"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", default=",".join(DEFAULT), help=f"settings (default: %(default)s); known: {', '.join(GRID)}")
    p.add_argument("--layers", default="1/3", help="STEM placement (default: %(default)s)")
    p.add_argument("--eval-batches", type=int, default=31, help="held-out batches of 4 x 256 tokens (31 = the whole "
                   "validation split; default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="zero and gated-par at 4k calibration tokens, 2 eval batches")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.grid.split(",")
    if args.quick:
        GRID["gated-par"][2].update(tokens=4096)
        names, args.eval_batches = ["zero", "gated-par"], 2
    unknown = [n for n in names if n not in GRID]
    if unknown:
        raise SystemExit(f"unknown grid settings {unknown}; known: {', '.join(GRID)}")
    out = RESULTS / ("insertion_step0.quick.json" if args.quick else "insertion_step0.json")
    result = json.loads(out.read_text()) if out.exists() else {"benchmark": "insertion_step0", "runs": {}}
    dense, train, val = dense_and_data()
    key = f"dense@{args.eval_batches}"
    if key not in result["runs"]:
        result["runs"][key] = {"setting": "dense", "layers": "none", "eval_batches": args.eval_batches,
                               "loss": held_out(dense, val, args.eval_batches)}
    val_ids = torch.from_numpy(np.asarray(val.tokens[: args.eval_batches * 4 * 256 + 1], dtype=np.int64))
    for name in names:
        k = f"{name}@{args.layers}@{args.eval_batches}"
        if k in result["runs"]:
            print(f"{k}: measured earlier, {result['runs'][k]['loss']:.3f}")
            continue
        model, info = build(dense, train, name, args.layers)
        seen = info.pop("seen", None)
        loss = held_out(model, val, args.eval_batches)
        entry = {"setting": name, "layers": args.layers, "eval_batches": args.eval_batches, "ffn": GRID[name][0],
                 "init": GRID[name][1], "calibration": GRID[name][2], "loss": loss,
                 "delta_vs_dense": loss - result["runs"][key]["loss"], **info, "git_commit": git_commit(),
                 "threads": torch.get_num_threads()}
        if seen is not None:
            entry["heldout_tokens_seen_share"] = float(seen[val_ids].float().mean())
        result["runs"][k] = entry
        result["git_commit"] = entry["git_commit"]  # the newest setting's; each entry keeps its own
        print(f"{k}: loss {loss:.3f} (dense {result['runs'][key]['loss']:.3f}, +{entry['delta_vs_dense']:.2f})", flush=True)
        RESULTS.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(result, indent=1))
        del model
    atomic_write_text(out, json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
