"""Mid-training insertion on one GPU (issue 24): SmolLM2-135M dense continued vs STEM-1/3 inserted, in lockstep.

    python benchmarks/gpu_midtrain.py --corpus DIR                 # on one H100: ~7.5 min for three seeds
    python benchmarks/gpu_midtrain.py --smoke                      # a random 3-layer Llama, on any device, seconds

The ``stem-calibrated-kd`` arm is the calibrated conversion trained with ``run.distill``: the KL to the
frozen dense model's next-token distribution on the same batch (the spec's ``distill`` settings).

The arms, their conversions (calibration settings included), learning rate, schedule, batch and
evaluation are those of ``studies/midtrain-gpu.yaml`` (``stemlm.study.midtrain.midtrain_runs``). What
differs from ``stemlm study run --spec midtrain-gpu`` is only the driving: every arm's trainer is built
first, then one optimizer step of each arm in turn (the same batches: each seed fixes the data order),
the validation loss of every arm every ``run.eval_every`` steps, and a wall-clock ``--budget-s`` (the
conversions included): a seed starts only if the time the last one took still fits, so whatever is cut,
every arm has seen the same tokens. The calibration pass runs on the GPU (``CalibrationConfig.device``).

``--corpus``: a prepared data dir in SmolLM2's vocabulary (the study builds it with
``corpus_for_tokenizer``; its train split is also the calibration text). Writes
``benchmarks/results/gpu_midtrain.json`` (``--out``): per seed and arm the step-0 and final validation
loss, the curve, the median step time and tokens/s, and STEM − dense at the end per seed with their
mean and spread; the device, torch version and commit.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _gpu_parts import sync
from stemlm.runtime.files import atomic_write_text
from stemlm.study.midtrain import converted_model, distill_overrides, midtrain_runs
from stemlm.study.spec import load_spec
from stemlm.train import Trainer, load_train_config
from stemlm.version import git_commit

HERE = Path(__file__).resolve().parent


def smoke_source(root: Path) -> tuple[Path, Path]:
    """A random 3-layer Llama directory and a prepared corpus in its 512-id vocabulary (``--smoke``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from _train_bench import synthetic_data_dir

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                         intermediate_size=128, vocab_size=512, max_position_embeddings=256))
    llama.save_pretrained(root / "llama")
    return root / "llama", synthetic_data_dir(512, n_tokens=60_000)


def stage(args, corpus: Path, source: str) -> tuple[dict, list]:
    """The ``midtrain`` section of the spec with this run's corpus, sizes and arms, and its run specs."""
    spec = load_spec(args.spec)
    m = dict(spec["midtrain"])
    m.update(source=source, data_dir=str(corpus), calib_data=str(corpus), seeds=args.seeds)
    m["arms"] = {name: arm for name, arm in m["arms"].items() if name in args.arms}
    missing = set(args.arms) - set(m["arms"])
    if missing:
        raise SystemExit(f"gpu_midtrain: unknown arms {sorted(missing)}; the spec has {sorted(spec['midtrain']['arms'])}")
    if args.smoke:
        m.update(steps=4, batch_size=2, seq_len=64, calibration={**m["calibration"], "tokens": 2048, "seq_len": 64},
                 train=[*m.get("train", []), "run.eval_every=2", "run.eval_batches=2"])
    return m, midtrain_runs(spec, m)


def build(run, root: Path, corpus: Path, log) -> Trainer:
    """The run's trainer, started from its converted model (converted once, calibrated on the GPU)."""
    init = converted_model(run.convert, root / "convert", log)
    cfg = load_train_config(None, None, [*run.overrides, f"run.out={root / 'runs' / run.name}", "run.progress=false",
                                         "run.compile=false", "run.plots=false", f"data.dir={corpus}",
                                         f"run.init_from={init}", *distill_overrides(run, root / "convert", log)])
    return Trainer(cfg)


def train_seed(runs: list, root: Path, corpus: Path, log) -> dict:
    """All arms of one seed, one step each in turn; their validation curves and step times."""
    trainers = {}
    for run in runs:
        t0 = time.perf_counter()
        trainers[run.labels["variant"]] = build(run, root, corpus, log)
        log(f"  {run.name}: ready in {time.perf_counter() - t0:.1f} s")
    first = next(iter(trainers.values()))
    steps, every = first.cfg.run.steps, first.cfg.run.eval_every
    out = {arm: {"curve": [], "step_s": [], "loss": []} for arm in trainers}
    for arm, t in trainers.items():
        out[arm]["curve"].append([0, 0, t.evaluate()["loss"]])
    for step in range(1, steps + 1):
        for arm, t in trainers.items():
            sync(t.device)
            t0 = time.perf_counter()
            rec = t.train_step()
            sync(t.device)
            out[arm]["step_s"].append(time.perf_counter() - t0)
            out[arm]["loss"].append(rec["loss"])
            if step % every == 0 or step == steps:
                out[arm]["curve"].append([step, t.tokens_seen, t.evaluate()["loss"]])
        if step % every == 0 or step == steps:
            log(f"  step {step}/{steps}: " + ", ".join(f"{a} {o['curve'][-1][2]:.4f}" for a, o in out.items()))
    for arm, t in trainers.items():
        o = out[arm]
        warm = o["step_s"][2:] or o["step_s"]
        o.update(init_loss=o["curve"][0][2], final_loss=o["curve"][-1][2], tokens=t.tokens_seen,
                 median_step_s=statistics.median(warm), tokens_per_s=t.tokens_per_step / statistics.median(warm),
                 table_path=getattr(t, "table_path", None),
                 # the process's peak so far (every arm of the seed on the GPU at once), the same for each arm
                 peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30 if t.device.type == "cuda" else None)
        t.close()
    del trainers
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def gaps(seeds: dict, arm: str, key: str = "final_loss") -> list[float]:
    """``arm``'s ``key`` minus dense's on the same seed, one value per seed that ran both."""
    return [s[arm][key] - s["dense"][key] for s in seeds.values() if arm in s and "dense" in s]


def summary(seeds: dict) -> dict:
    """Each STEM arm minus dense at the end (per seed, mean, sample sd) and at step 0."""
    out = {}
    arms = {a for s in seeds.values() for a in s if a != "dense"}
    for arm in sorted(arms):
        final, init = gaps(seeds, arm), gaps(seeds, arm, "init_loss")
        ratio = [s[arm]["median_step_s"] / s["dense"]["median_step_s"] for s in seeds.values() if arm in s and "dense" in s]
        out[arm] = {"final_gap_per_seed": final, "final_gap_mean": statistics.fmean(final) if final else None,
                    "final_gap_sd": statistics.stdev(final) if len(final) > 1 else None,
                    "init_gap": statistics.fmean(init) if init else None,
                    "step_time_ratio_to_dense": statistics.fmean(ratio) if ratio else None}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, help="prepared data dir in SmolLM2's vocabulary (train + val splits)")
    p.add_argument("--spec", default="midtrain-gpu", help="study spec whose midtrain section is run (default: %(default)s)")
    p.add_argument("--arms", default="dense,stem-calibrated,stem-calibrated-kd,stem-gradual",
                   help="comma-separated arms of the spec, dense first (default: %(default)s)")
    p.add_argument("--seeds", default="0,1,2", help="seeds, run in turn while the budget lasts (default: %(default)s)")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="wall-clock seconds for all seeds; a seed starts only if the last one's time still fits")
    p.add_argument("--scratch", type=Path, default=None, help="converted models and run dirs (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default: benchmarks/results/gpu_midtrain.json)")
    p.add_argument("--smoke", action="store_true", help="a random 3-layer Llama and random tokens: checks the path")
    args = p.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    if args.arms[:1] != ["dense"]:
        raise SystemExit("gpu_midtrain: --arms must start with dense (every gap is to it)")
    if not args.smoke and (args.corpus is None or not (args.corpus / "meta.json").exists()):
        raise SystemExit("gpu_midtrain: --corpus must be a prepared data dir in SmolLM2's vocabulary (has meta.json)")
    out_path = args.out or HERE / "results" / ("gpu_midtrain.smoke.json" if args.smoke else "gpu_midtrain.json")
    root = args.scratch or Path(tempfile.mkdtemp(prefix="stemlm-gpu-midtrain-"))
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    if args.smoke:
        source, corpus = smoke_source(root)
    else:
        source, corpus = "smollm2", args.corpus
    m, runs = stage(args, corpus, str(source))
    result = {"benchmark": "gpu_midtrain", "spec": args.spec, "smoke": args.smoke, "arms": args.arms,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
              "torch": torch.__version__, "cuda": torch.version.cuda, "git_commit": git_commit(),
              "settings": {k: m.get(k) for k in ("steps", "batch_size", "seq_len", "lr", "stem_layers", "calibration", "train")},
              "corpus": str(corpus), "seeds": {}, "seeds_skipped": []}
    for run in runs:  # every conversion first (one per arm, shared by the seeds): a seed's time is then its own
        converted_model(run.convert, root / "convert", log)
    seed_s = 0.0
    for seed in args.seeds:
        left = args.budget_s - (time.perf_counter() - t_start)
        if result["seeds"] and seed_s > left:
            log(f"seed {seed}: skipped, {left:.0f} s left and a seed took {seed_s:.0f} s")
            result["seeds_skipped"].append(seed)
            continue
        t0 = time.perf_counter()
        log(f"seed {seed}")
        result["seeds"][str(seed)] = train_seed([r for r in runs if r.labels["seed"] == seed], root, corpus, log)
        seed_s = time.perf_counter() - t0
        result["summary"] = summary(result["seeds"])
        result["wall_s"] = time.perf_counter() - t_start
        out_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_path, json.dumps(result, indent=1))
        log(f"seed {seed} done in {seed_s:.0f} s; wrote {out_path}")
    for arm, s in result.get("summary", {}).items():
        sd = f" ± {s['final_gap_sd']:.4f} (sd)" if s["final_gap_sd"] is not None else ""
        print(f"{arm} − dense: step 0 {s['init_gap']:+.4f}, end {s['final_gap_mean']:+.4f}{sd} nats over "
              f"{len(s['final_gap_per_seed'])} seeds; step time ×{s['step_time_ratio_to_dense']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
