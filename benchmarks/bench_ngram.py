"""P-ngram: what n-gram keys cost next to token keys (issue 36's cost goals), measured side by side in one run.

Three ratios, each from interleaved rounds (the two calls of a round run back to back, so slow phases of
the shared machine move whole rounds and cancel in each ratio; the median over rounds is reported with
the rounds' spread):

1. **train step**: ``Trainer.train_step`` of ``ngram-<placement>`` ÷ ``stem-<placement>`` on the same
   backbone and data (the real loop: forward, backward, table optimizer, clipping, AdamW). Goal ≤ 1.10 at
   the tiny shape. Both placements 1/3 and full are timed.
2. **decode on the host tier**: greedy decode tokens/s of an ``ngram-1/3`` model with its tables in host RAM
   (``Placement("host")``, prefetch on) ÷ the same model with its tables on the device (here: the CPU).
   Goal ≥ 0.9. The generated tokens must be identical (checked).
3. **hashing**: the seconds of computing the newest position's keys in a decode step (hashed from each
   sequence's last tokens, ``DecodeCore._step_keys``) ÷ a whole decode step of the same batch. Goal ≤ 2 %.

    python benchmarks/bench_ngram.py            # tiny preset (the goals' shape), ~3 min on 2 quiet cores
    python benchmarks/bench_ngram.py --quick    # smoke run: debug preset, writes ngram_cost.quick.json

Writes ``results/ngram_cost[.quick].json``. Time it on a quiet machine: nothing else running.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _train_bench import make_trainer, paired_ratio, round_ratios, synthetic_data_dir, time_interleaved, write_result

from stemlm.config import ModelConfig
from stemlm.inference.core import DecodeCore, Generation
from stemlm.inference.sampling import SamplingParams
from stemlm.model.decoder import StemLM
from stemlm.presets import PRESETS, model_config
from stemlm.store import Placement
from stemlm.store.offload import offload_tables

GOALS = {"train_step_ratio_max": 1.10, "host_decode_ratio_min": 0.9, "hash_share_max": 0.02}


def spread(values: list[float]) -> dict:
    """Median, min and max of per-round values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": len(values)}


def train_steps(preset: str, batch: int, seq: int, steps: int, placement: str) -> dict:
    """Interleaved train steps of ngram-<placement> and stem-<placement>; their per-round ratio."""
    common = [f"data.dir={synthetic_data_dir(PRESETS[preset]['vocab_size'])}", f"data.batch_size={batch}",
              f"data.seq_len={seq}", f"model.max_seq_len={max(seq, 64)}", f"model.stem_layers={placement}",
              f"run.steps={steps + 10}"]
    trainers = {kind: make_trainer([f"model.ffn={kind}", *common], preset) for kind in ("stem", "ngram")}
    step = {k: (lambda t=t: t.train_step()) for k, t in trainers.items()}
    samples: dict = {}
    medians = time_interleaved(step, steps, warmup=2, samples=samples)
    ratios = round_ratios(samples["ngram"], samples["stem"])
    return {"placement": placement, "seconds": medians, "ratio": paired_ratio(samples["ngram"], samples["stem"]),
            "ratio_rounds": spread(ratios), "tokens_per_step": batch * seq}


def _model(cfg: ModelConfig, tier: str) -> StemLM:
    torch.manual_seed(0)
    model = StemLM(cfg).eval()
    if tier != "device":
        offload_tables(model, Placement(tier))
    return model


def _decode(model, prompts: list[list[int]], new: int) -> tuple[float, list]:
    """Seconds to decode ``new`` greedy tokens for every prompt in one batch (prefill excluded), and the tokens."""
    core = DecodeCore(model, graphs="off")
    gens = [Generation(p, SamplingParams(max_new_tokens=new, temperature=0.0)) for p in prompts]
    core.add(gens)
    t0 = time.perf_counter()
    while core.running:
        core.step()
    return time.perf_counter() - t0, [g.tokens for g in gens]


def decode(preset: str, rounds: int, new: int, batch: int) -> dict:
    """Host-tier ÷ device-tier decode speed of ngram-1/3 (interleaved rounds) and the hashing share of a step."""
    cfg = model_config(preset, ffn="ngram", stem_layers="1/3")
    models = {tier: _model(cfg, tier) for tier in ("device", "host")}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, cfg.vocab_size, (16,), generator=gen).tolist() for _ in range(batch)]
    times: dict = {t: [] for t in models}
    tokens = {}
    for tier, m in models.items():  # warm-up
        _decode(m, prompts, 4)
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for tier in order:
            s, tokens[tier] = _decode(models[tier], prompts, new)
            times[tier].append(s)
    speed = {t: [batch * new / s for s in v] for t, v in times.items()}
    ratio = round_ratios(speed["host"], speed["device"])
    # hashing inside one decode step of the device model: the context rows and the keys, against the whole step
    m = models["device"]
    core = DecodeCore(m, graphs="off")
    gens = [Generation(p, SamplingParams(max_new_tokens=10_000, temperature=0.0)) for p in prompts]
    core.add(gens)
    ids = torch.tensor([g.tokens[-1] for g in gens])[:, None]

    def keys():  # what a step hashes: from the sequences' token lists (the ids-and-context path where it must)
        if core._step_keys(core.running) is None:
            m.table_keys(ids, core._context(core.running))

    def step():
        core.step()
        if len(gens[0].tokens) > cfg.max_seq_len - 40:  # stay inside the context
            core.drop(core.running)
            core.add([Generation(p, SamplingParams(max_new_tokens=10_000, temperature=0.0)) for p in prompts])

    samples: dict = {}
    time_interleaved({"keys": keys, "step": step}, rounds * 20, warmup=3, samples=samples)
    share = round_ratios(samples["keys"], samples["step"])
    return {"batch": batch, "new_tokens": new, "tokens_per_second": {t: statistics.median(v) for t, v in speed.items()},
            "host_over_device": paired_ratio(speed["host"], speed["device"]), "host_over_device_rounds": spread(ratio),
            "same_tokens": tokens["host"] == tokens["device"],
            "hash_seconds": statistics.median(samples["keys"]), "step_seconds": statistics.median(samples["step"]),
            "hash_share": statistics.median(share), "hash_share_rounds": spread(share),
            "host_stats": {k: v for k, v in models["host"].tables.stats().items() if k != "per_table"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="model shape (default: tiny)")
    ap.add_argument("--batch-size", type=int, default=16, help="training sequences per step (default: 16)")
    ap.add_argument("--seq-len", type=int, default=256, help="training tokens per sequence (default: 256)")
    ap.add_argument("--steps", type=int, default=30, help="timed train steps per kind and placement (default: 30)")
    ap.add_argument("--rounds", type=int, default=7, help="decode rounds per tier (default: 7)")
    ap.add_argument("--new-tokens", type=int, default=48, help="decoded tokens per round (default: 48)")
    ap.add_argument("--decode-batch", type=int, default=4, help="sequences decoded together (default: 4)")
    ap.add_argument("--quick", action="store_true", help="debug preset, a few steps: ngram_cost.quick.json")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.batch_size, args.seq_len, args.steps, args.rounds, args.new_tokens = "debug", 4, 64, 3, 2, 8
    torch.manual_seed(0)
    train = [train_steps(args.preset, args.batch_size, args.seq_len, args.steps, p) for p in ("1/3", "full")]
    dec = decode(args.preset, args.rounds, args.new_tokens, args.decode_batch)
    met = {"train_step_ratio": all(t["ratio"] <= GOALS["train_step_ratio_max"] for t in train),
           "host_decode_ratio": dec["host_over_device"] >= GOALS["host_decode_ratio_min"] and dec["same_tokens"],
           "hash_share": dec["hash_share"] <= GOALS["hash_share_max"]}
    for t in train:
        r = t["ratio_rounds"]
        print(f"train step ngram-{t['placement']} ÷ stem-{t['placement']}: {t['ratio']:.3f} "
              f"(rounds {r['min']:.3f}..{r['max']:.3f}; {1e3 * t['seconds']['ngram']:.1f} vs "
              f"{1e3 * t['seconds']['stem']:.1f} ms)  goal <= {GOALS['train_step_ratio_max']}")
    r = dec["host_over_device_rounds"]
    print(f"decode ngram-1/3 host ÷ device: {dec['host_over_device']:.3f} (rounds {r['min']:.3f}..{r['max']:.3f}; "
          f"{dec['tokens_per_second']['host']:.1f} vs {dec['tokens_per_second']['device']:.1f} tok/s, same tokens "
          f"{dec['same_tokens']})  goal >= {GOALS['host_decode_ratio_min']}")
    r = dec["hash_share_rounds"]
    print(f"hashing ÷ decode step: {100 * dec['hash_share']:.2f} % (rounds {100 * r['min']:.2f}..{100 * r['max']:.2f} %; "
          f"{1e6 * dec['hash_seconds']:.0f} µs of {1e3 * dec['step_seconds']:.2f} ms)  goal <= "
          f"{100 * GOALS['hash_share_max']:.0f} %")
    path = write_result("ngram_cost", args.quick, {"preset": args.preset, "goals": GOALS, "met": met, "train": train,
                                                   "decode": dec})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
