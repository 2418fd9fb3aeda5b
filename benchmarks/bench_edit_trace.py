"""Where SmolLM2-135M keeps its capitals, and so which STEM placement could carry a row edit.

Activation patching on the dense model (``stemlm.edit.trace``): for pairs of capital facts it knows
("The capital of Spain is" / "The capital of Germany is", same template and token length), the other
country's activations at the subject's tokens are put into the subject prompt:

* ``up`` at a set of layers — the ceiling of a row swap in a model converted from this one, with STEM at
  those layers and rows equal to the dense up-projection at this very context (calibrated rows are a
  mean over contexts, so they can only do worse, before any training);
* ``ffn`` at a set of layers — the ceiling of a table of whole FFN outputs at the subject;
* ``resid`` entering one layer — classic causal tracing: until which layer the subject's tokens still
  carry the fact (layer 0 = the input embedding = renaming the token: the positive control).

    python benchmarks/bench_edit_trace.py            # -> benchmarks/results/edit_trace.json (~20 min, 1 thread)
    python benchmarks/bench_edit_trace.py --quick    # 16 cases, a few layers

The dense conversion lives under ``runs/edit_trace/`` (not in git); results carry the git commit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from stemlm.runtime.files import atomic_write_text
from stemlm.version import git_commit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("STEMLM_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
RUN_DIR = ROOT / "runs" / "edit_trace"
SPLITS = ("heldout_template", "train")


def dense_model(out: Path):
    """``(model, facts, codec)`` of SmolLM2-135M converted as dense (once)."""
    from stemlm.data import corpus_in_vocabulary, load_facts
    from stemlm.edit.load import load_model_and_tokenizer
    from stemlm.interop.convert import convert_from_hf

    if not (out / "config.json").exists():
        convert_from_hf("smollm2", out, ffn="dense", log=print)
    corpus = corpus_in_vocabulary(out / "tokenizer.json")
    model, tok = load_model_and_tokenizer(out, corpus)
    return model.eval(), load_facts(corpus), tok


def placements(n_layers: int) -> dict[str, list[int]]:
    """The paper's placements and contiguous thirds; ``all`` includes layer 0 (never STEM in the paper)."""
    from stemlm.config import resolve_stem_layers

    third = n_layers // 3
    return {"1/3": list(resolve_stem_layers("1/3", n_layers)), "1/2": list(resolve_stem_layers("1/2", n_layers)),
            "full": list(range(1, n_layers)), "early": list(range(1, third + 1)),
            "middle": list(range(third + 1, 2 * third + 1)), "late": list(range(2 * third + 1, n_layers)),
            "all": list(range(n_layers))}


def wilson(p: float | None, n: int) -> list[float] | None:
    """95% Wilson interval of a proportion ``p`` over ``n`` cases."""
    if p is None or n == 0:
        return None
    z = 1.96
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, mid - half), min(1.0, mid + half)]


def trace_split(model, tok, facts, split: str, n_cases: int, singles: list[int], sets: dict) -> dict:
    from stemlm.edit.probes import build_probes
    from stemlm.edit.trace import known_cases, patch_effects

    probes = build_probes(facts, tok, split, ("capital",))
    cases = known_cases(model, probes, n_cases, seed=0)
    print(f"{split}: {len(cases)} cases over {len({c.subject.country for c in cases})} countries")
    out = {"cases": len(cases), "countries": len({c.subject.country for c in cases}), "kinds": {}}
    single_sets = {str(i): [i] for i in singles}
    for kind in ("up", "ffn", "resid"):
        t0 = time.perf_counter()
        chosen = single_sets if kind == "resid" else {**sets, **single_sets}
        res = patch_effects(model, cases, kind, chosen)
        for r in res.values():
            r["flip_ci"] = wilson(r["flip"], r["cases"])
        out["kinds"][kind] = res
        best = max(res.items(), key=lambda kv: kv[1]["flip"] or 0)
        print(f"  {kind:>5}: {len(chosen)} layer sets in {time.perf_counter() - t0:.0f}s; "
              + "  ".join(f"{k} {v['flip']:.2f}" for k, v in res.items() if not k.isdigit())
              + f"  best single/set {best[0]} {best[1]['flip']:.2f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="16 cases per split, layers 0, 1, 5 only")
    p.add_argument("--cases", type=int, default=120, help="fact pairs per phrasing split (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, facts, tok = dense_model(RUN_DIR / "smollm2-dense")
    n = model.cfg.n_layers
    singles = [0, 1, 5] if args.quick else list(range(n))
    sets = placements(n)
    cases = 16 if args.quick else args.cases
    result = {"benchmark": "edit_trace", "git_commit": git_commit(), "model": "SmolLM2-135M-Instruct (GGUF Q4_1)",
              "relation": "capital", "n_layers": n, "placements": sets,
              "splits": {s: trace_split(model, tok, facts, s, cases, singles, sets) for s in SPLITS},
              "seconds": time.perf_counter() - t0, "threads": torch.get_num_threads()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / ("edit_trace.quick.json" if args.quick else "edit_trace.json")
    atomic_write_text(out, json.dumps(result, indent=1))
    print(f"wrote {out} in {result['seconds']:.0f}s")


if __name__ == "__main__":
    main()
