"""One converted layer, distilled three ways: what training ``W_g`` adds, on held-out text in and out of domain.

SmolLM2-135M's FFN at one layer (default 14, one of the ten the default conversion picks) is converted alone on the
dense model's own hidden states (``calibrate --calib-parallel``'s inputs): rows fitted as ``convert`` does (gated,
shrink 4096, ids never seen get the pooled row) and ``W_d`` refitted, by ``convert``'s own ``fit_layer``, then distilled by ``stemlm.insert.distill``
with the same steps, batch and lr twice: rows + ``W_d``, and rows + ``W_d`` + ``W_g`` (``--distill-gate``). Each
variant's relative output error ``Σ‖out − y‖² / Σ‖y‖²`` (0 = the dense layer) is measured on the calibration tokens
and on the held-out sets of ``bench_insertion_grid.py`` (the corpus's validation split; technical and legal prose),
also at the positions whose id the calibration showed fewer than 16 times.

    python benchmarks/bench_distill_layer.py --python-doc auto            # -> distill_layer.json (~10 min, 2 threads)
    python benchmarks/bench_distill_layer.py --python-doc auto --layer 20 --steps 400

This isolates the layer-level effect of training ``W_g``; the grid measures whole conversions (one seed each).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_insertion import RESULTS, WORK, dense_and_data  # noqa: E402
from bench_insertion_grid import ood_texts, python_doc_deb, token_windows  # noqa: E402

from stemlm.insert.calibrate import CalibrationConfig, calibration_windows, chunk_slices, fit_layer  # noqa: E402
from stemlm.insert.distill import DistillSettings, distill_layer, layer_output, relative_error  # noqa: E402
from stemlm.runtime.files import atomic_write_text  # noqa: E402
from stemlm.version import git_commit  # noqa: E402

RARE = 16


class _Reached(Exception):
    """Raised by ``layer_io``'s hook once the layer's input is kept."""


@torch.no_grad()
def layer_io(dense, layer: int, windows: torch.Tensor, chunk: int = 8) -> dict[str, torch.Tensor]:
    """At ``layer`` over ``windows``: the stream after the attention ``(n, T, d)`` (what ``fit_layer`` fits from),
    the normed FFN inputs ``x`` and the dense FFN's outputs ``y`` ``(n·T, d)``, and the ids ``(n·T,)``."""
    seen: list[torch.Tensor] = []
    block = dense.layers[layer]

    def keep_and_stop(module, args):  # the layers above (and the LM head) are not needed: stop the forward here
        seen.append(args[0].clone())
        raise _Reached

    hook = block.ffn_norm.register_forward_pre_hook(keep_and_stop)
    try:
        for a in range(0, len(windows), chunk):
            try:
                dense(windows[a:a + chunk])
            except _Reached:
                pass
    finally:
        hook.remove()
    stream = torch.cat(seen)
    x = block.ffn_norm(stream).reshape(-1, stream.shape[-1])
    return {"stream": stream, "x": x, "y": block.ffn(x), "ids": windows.reshape(-1)}


@torch.no_grad()
def fit_as_convert(dense, layer: int, stream: torch.Tensor, windows: torch.Tensor, calib: CalibrationConfig):
    """``(rows, refitted projections)`` of ``layer`` fitted from ``stream`` (``layer_io``'s) as ``convert`` fits it
    (gated rows, shrink, pooled unseen, the ``W_d`` refit): its own ``fit_layer``."""
    return fit_layer(dense.layers[layer], "stem", stream, windows, chunk_slices(len(windows), calib.chunk), calib,
                     dense.tok_embeddings.weight, refine=True)


@torch.no_grad()
def errors(ffn, sets: dict, counts: torch.Tensor, rows: torch.Tensor, weights: dict) -> dict:
    """Per set: the relative output error over every position and over those of ids seen < RARE times."""
    out = {}
    for name, io in sets.items():
        x, y, ids = io["x"], io["y"], io["ids"]
        pred = layer_output(ffn, "stem", x, rows[ids], weights)
        rare = counts[ids] < RARE
        out[name] = {"all": relative_error(pred, y), f"rare<{RARE}": relative_error(pred[rare], y[rare]),
                     "rare_share": float(rare.float().mean())}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python-doc", required=True, help="the python3.11-doc .deb, or auto (see bench_insertion_grid.py)")
    p.add_argument("--layer", type=int, default=14, help="the converted layer (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=65_536, help="calibration tokens (default: %(default)s)")
    p.add_argument("--steps", type=int, default=1000, help="distillation steps of each variant (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1024, help="tokens per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="distillation lr (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS / "distill_layer.json", help="results JSON (default: %(default)s)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from tokenizers import Tokenizer

    dense, train, val = dense_and_data()
    if not 0 <= args.layer < dense.cfg.n_layers:
        raise SystemExit(f"--layer {args.layer} is outside the model's {dense.cfg.n_layers} layers")
    tok = Tokenizer.from_file(str(WORK / "smollm2-dense" / "tokenizer.json"))
    texts, sources = ood_texts(python_doc_deb(args.python_doc))
    held = {"in_domain": token_windows(val.tokens, 8)[:-1].reshape(-1, 256)}
    for domain, text in texts.items():
        held[domain] = token_windows(np.asarray(tok.encode(text).ids), 8)[:-1].reshape(-1, 256)
    calib = CalibrationConfig(tokens=args.tokens)
    windows = calibration_windows(train.tokens, calib.tokens, calib.seq_len)  # (n, 256)
    t0 = time.perf_counter()
    sets = {k: layer_io(dense, args.layer, w) for k, w in {"calibration": windows, **held}.items()}
    print(f"captured layer {args.layer}'s inputs in {time.perf_counter() - t0:.0f} s", flush=True)
    block, vocab = dense.layers[args.layer], dense.cfg.vocab_size
    ffn, x, ids = block.ffn, sets["calibration"]["x"], sets["calibration"]["ids"]
    rows, fitted = fit_as_convert(dense, args.layer, sets["calibration"]["stream"], windows, calib)
    counts = torch.bincount(ids, minlength=vocab)
    variants = {"fit + W_d refit": errors(ffn, sets, counts, rows, fitted)}
    print(f"fit + W_d refit: {json.dumps(variants['fit + W_d refit'])}", flush=True)
    timings = {}
    for name, gate_too in (("distilled: rows + W_d", False), ("distilled: rows + W_d + W_g", True)):
        settings = DistillSettings(args.steps, args.lr, args.batch, train_down=True, train_gate=gate_too,
                                   rows="dense", precision="fp32")  # as its committed results were measured
        t0 = time.perf_counter()
        with torch.enable_grad():
            r, w, info = distill_layer(ffn, "stem", x, ids, rows, fitted, settings, progress=True, desc=name)
        timings[name] = time.perf_counter() - t0
        variants[name] = {**errors(ffn, sets, counts, r, w), "kept_start": info["kept_start"]}
        print(f"{name} ({timings[name]:.0f} s): {json.dumps(variants[name])}", flush=True)
    result = {"benchmark": "distill_layer", "layer": args.layer, "calib_tokens": int(ids.numel()),
              "calibration": {"method": calib.method, "shrink": calib.shrink, "unseen": calib.unseen,
                              "inputs": "the dense model's own hidden states"},
              "distill": {"steps": args.steps, "batch": args.batch, "lr": args.lr},
              "held_out_tokens": {k: int(w.numel()) for k, w in held.items()}, "sources": sources,
              "rare_below": RARE, "variants": variants, "distill_seconds": timings, "threads": args.threads,
              "git_commit": git_commit()}
    atomic_write_text(args.out, json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
