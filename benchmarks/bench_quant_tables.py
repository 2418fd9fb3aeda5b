"""Quantized tables: stored bytes, validation perplexity and decode speed by table dtype (fp32, bf16, int8, int4).

Models (``--models``, default ``tiny,smollm2``):

* ``tiny``: the tiny preset with STEM in every third layer, trained ``--tiny-steps`` steps on the
  default corpus (once, cached), or ``--tiny-ckpt PATH`` (e.g. a study run's checkpoint);
* ``smollm2``: SmolLM2-135M converted to STEM-1/3 with calibrated tables (once, cached), or
  ``--smollm2-ckpt PATH`` (e.g. the study's mid-trained one); its validation text is the default
  corpus tokenized with SmolLM2's own tokenizer.

Per model and table dtype: the bytes of the stored tables, the validation loss over the same
``--batches`` windows (tables re-encoded at load, ``open_model(table_dtype=...)``) and
its change against fp32 in perplexity (``exp(Δloss) - 1``). Goal: int8 within +0.5 %.

Decode (tiny model): int8 tables served from a tables file on disk against fp32 tables in RAM
(the device tier), in ``--repeats`` alternating rounds of ``--gens`` seeded sampled generations;
the speed ratio is the median over rounds of disk-int8 ÷ RAM-fp32.

    python benchmarks/bench_quant_tables.py                          # the real run
    python benchmarks/bench_quant_tables.py --quick                  # debug shape, untrained, seconds
    python benchmarks/bench_quant_tables.py --tiny-ckpt runs/study/full/runs/compare-d256-stem-1_3-seed0-*
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _store_bench import timed_decode
from _train_bench import bench_work, paired_ratio, round_ratios, write_result

from stemlm.runtime.artifacts import cache_dir
from stemlm.checkpoint.directory import resolve_checkpoint
from stemlm.data import TokenDataset, count_eval_batches
from stemlm.model.quant import TABLE_DTYPES, RowCodec
from stemlm.store import Placement, export_tables, open_model
from stemlm.train.evaluate import evaluate

HOME = bench_work(cache_dir() / "bench" / "quant")


def trained_tiny(steps: int, preset: str = "tiny") -> Path:
    """A ``preset`` STEM-1/3 model trained ``steps`` steps on the default corpus (cached by preset and steps)."""
    from stemlm.train import load_train_config, train

    out = HOME / f"{preset}-stem13-{steps}"
    if (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("step_*")):
        return out
    cfg = load_train_config(preset, None, [f"run.out={out}", f"run.steps={steps}", "model.ffn=stem",
                                           "model.stem_layers=1/3", "run.plots=false", f"run.ckpt_every={steps}"])
    train(cfg)
    return out


def smollm2_stem(ckpt: str | None) -> tuple[Path, Path]:
    """``(checkpoint, data_dir)``: SmolLM2-135M as STEM-1/3 (tables calibrated on 65,536 tokens of the corpus's
    training split, uniform layers, W_d refitted, shrink 1024: ~5 min on 2 cores) and the corpus in its tokenizer.
    Calibrated, not ``project``: projected tables carry no learned signal (loss ~20), which says nothing about
    what quantization costs."""
    from stemlm.study.midtrain import converted_model, corpus_for_tokenizer

    convert = {"source": "smollm2", "ffn": "stem", "stem_layers": "1/3", "init": "calibrate",
               "calibration": {"tokens": 65_536, "shrink": 1024.0, "layer_choice": "uniform"}}
    model_dir = Path(ckpt) if ckpt else converted_model(convert, HOME / "models")
    return resolve_checkpoint(model_dir), corpus_for_tokenizer(converted_model(convert, HOME / "models")
                                                               if ckpt else model_dir, HOME / "corpora", "smollm2")


def table_bytes(cfg, name: str) -> int:
    """Bytes of a model's tables stored as ``name`` (``tests/test_quant.py`` checks it against written files)."""
    return sum(cfg.table_rows(i) for i in cfg.table_layers) * RowCodec(name).row_bytes(cfg.d_ff)


def val_losses(ckpt: Path, data_dir: Path, batches: int, batch_size: int, seq_len: int) -> dict:
    """Per table dtype: stored table bytes and validation loss over the same windows."""
    ds = TokenDataset.open(data_dir, "val")
    batches = min(batches, count_eval_batches(ds, batch_size, seq_len))
    out = {}
    for name in TABLE_DTYPES:
        model = open_model(ckpt, Placement("device", table_dtype=name))
        t0 = time.perf_counter()
        res = evaluate(model, ds, batch_size, seq_len, batches)
        out[name] = {"table_bytes": table_bytes(model.cfg, name), "val_loss": res["loss"], "tokens": res["tokens"],
                     "seconds": round(time.perf_counter() - t0, 2)}
        print(f"  {name:5s} tables {out[name]['table_bytes'] / 1e6:9.1f} MB   val loss {res['loss']:.6f}", flush=True)
    base = out["fp32"]
    for r in out.values():
        r["bytes_ratio_vs_fp32"] = base["table_bytes"] / r["table_bytes"]
        r["ppl_change_pct"] = 100 * (math.exp(r["val_loss"] - base["val_loss"]) - 1)
    return {"batches": batches, "batch_size": batch_size, "seq_len": seq_len, "data": str(data_dir), "by_dtype": out}


def decode_rounds(ckpt: Path, work: Path, repeats: int, gens: int, new_tokens: int, prompt_len: int) -> dict:
    """Decode tokens/s of int8 tables on disk vs fp32 tables in RAM, alternating rounds."""
    tables = export_tables(ckpt, work / "tables-int8.safetensors", table_dtype="int8", overwrite=True)
    ram = open_model(ckpt, "device")
    disk = open_model(ckpt, Placement("disk", tables_file=tables))
    store = disk.tables
    models = {"ram_fp32": ram, "disk_int8": disk}
    vocab = ram.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(i)) for i in range(gens)]
    speed = {name: [] for name in models}
    agree = []
    for r in range(repeats):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        tokens = {}
        for name in order:
            n, seconds = 0, 0.0
            for i, prompt in enumerate(prompts):
                toks, _, decode_s = timed_decode(models[name], prompt, new_tokens, seed=i)
                tokens.setdefault(name, []).append(toks)
                n, seconds = n + len(toks) - 1, seconds + decode_s
            speed[name].append(n / seconds)
        agree.append(statistics.mean(sum(a == b for a, b in zip(x, y)) / len(x)
                                     for x, y in zip(tokens["ram_fp32"], tokens["disk_int8"])))
        print(f"  round {r + 1}: RAM fp32 {speed['ram_fp32'][-1]:7.1f} tok/s, disk int8 {speed['disk_int8'][-1]:7.1f} tok/s",
              flush=True)
    stats = store.stats()
    store.close()
    return {"tokens_per_s": speed, "ratio_disk_int8_vs_ram_fp32": paired_ratio(speed["disk_int8"], speed["ram_fp32"]),
            "round_ratios": round_ratios(speed["disk_int8"], speed["ram_fp32"]),
            "ratio_of_medians": statistics.median(speed["disk_int8"]) / statistics.median(speed["ram_fp32"]),
            "sampled_tokens_equal_fraction": statistics.mean(agree), "bytes_moved_disk": stats["bytes_moved"],
            "rows_moved_disk": stats["rows_moved"], "row_bytes_int8": RowCodec("int8").row_bytes(ram.cfg.d_ff),
            "gens": gens, "new_tokens": new_tokens, "prompt_len": prompt_len, "repeats": repeats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2", help="comma list of tiny, smollm2 (default: both)")
    ap.add_argument("--tiny-ckpt", default=None, help="a trained tiny STEM checkpoint (default: train one, cached)")
    ap.add_argument("--tiny-steps", type=int, default=400, help="training steps of the default tiny model (default 400)")
    ap.add_argument("--smollm2-ckpt", default=None, help="a SmolLM2 STEM checkpoint (default: convert one, cached)")
    ap.add_argument("--batches", type=int, default=40, help="validation windows per model (default 40)")
    ap.add_argument("--repeats", type=int, default=5, help="decode rounds (default 5)")
    ap.add_argument("--gens", type=int, default=3, help="generations per round and model (default 3)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per generation (default 64)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--quick", action="store_true", help="debug preset trained 20 steps, tiny model only, 1 round")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.models, args.tiny_steps, args.batches, args.repeats, args.gens, args.new_tokens = "tiny", 20, 4, 1, 1, 8
    models = args.models.split(",")
    result = {"goal": "int8 tables: validation perplexity within +0.5 % of fp32", "models": {}}
    with tempfile.TemporaryDirectory(prefix="stemlm-quant-") as tmp:
        work = Path(tmp)
        if "tiny" in models:
            run = args.tiny_ckpt or trained_tiny(args.tiny_steps, "debug" if args.quick else "tiny")
            ckpt = resolve_checkpoint(run)
            print(f"tiny: {ckpt}", flush=True)
            from stemlm.train.evaluate import _stored_run_config

            data = _stored_run_config(ckpt).get("data", {})
            data_dir = Path(data.get("dir") or cache_dir() / "data" / "default-v1")
            result["models"]["tiny"] = {"checkpoint": str(ckpt), **val_losses(ckpt, data_dir, args.batches,
                                        data.get("batch_size", 16), data.get("seq_len", 128))}
            print("decode: int8 tables on disk vs fp32 tables in RAM", flush=True)
            result["decode"] = decode_rounds(ckpt, work, args.repeats, args.gens, args.new_tokens, 16)
        if "smollm2" in models:
            ckpt, data_dir = smollm2_stem(args.smollm2_ckpt)
            print(f"smollm2: {ckpt}", flush=True)
            result["models"]["smollm2"] = {"checkpoint": str(ckpt), **val_losses(ckpt, data_dir, args.batches, 4, 128)}
    for name, r in result["models"].items():
        changes = ", ".join(f"{k} {v['ppl_change_pct']:+.3f} % (÷{v['bytes_ratio_vs_fp32']:.2f} bytes)"
                            for k, v in r["by_dtype"].items() if k != "fp32")
        print(f"{name}: perplexity vs fp32: {changes}")
    if "decode" in result:
        d = result["decode"]
        print(f"decode disk int8 ÷ RAM fp32: {d['ratio_disk_int8_vs_ram_fp32']:.2f}x (median of per-round ratios; "
              f"ratio of medians {d['ratio_of_medians']:.2f})")
    print(f"wrote {write_result('quant_tables', args.quick, result)}")


if __name__ == "__main__":
    main()
