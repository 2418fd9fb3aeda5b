"""P7: training tokens/s of stemlm (dense) ÷ Hugging Face LlamaForCausalLM (sdpa), same shape.

Shape: d=256, 6 layers, 8 heads / 4 KV heads, d_ff=688, V=8192, 16 × 256 tokens per step.
stemlm runs its real training loop (``Trainer.train_step``); HF runs the textbook loop
(``model(input_ids, labels)``, backward, clip, AdamW) on the same batches. Same optimizer
hyperparameters and the same numerics on both sides (fp32, or bf16 autocast on both with
``--dtype bfloat16``); steps are interleaved. Goal: ratio >= 1.3, judged on the median of the
per-round ratios (robust to the machine's speed drifting during the run); the ratio of the median
step times and of the fastest steps are printed next to it. stemlm runs with its defaults
(``run.matmul=aten``: PyTorch's GEMMs, as HF). Two more stemlm contestants are timed in the same
rounds and reported beside: ``run.matmul=onednn`` (oneDNN's GEMMs, the default until a paired A/B
across processes, ``bench_matmul_ab.py``, found ATen faster) and ``run.compile=true`` (each block
compiled). Results written before that change hold ``ratio_aten`` (the default was oneDNN then).

    python benchmarks/bench_vs_hf.py
    python benchmarks/bench_vs_hf.py --quick
"""

from __future__ import annotations

import argparse

import torch
from _train_bench import make_trainer, paired_ratio, synthetic_data_dir, time_interleaved, write_result

from stemlm.train.evaluate import autocast


def hf_step_fn(trainer, hf_model, dtype: str):
    """One HF training step on the batch stemlm's trainer would use at the same step."""
    opt = torch.optim.AdamW(hf_model.parameters(), lr=trainer.cfg.optim.lr, betas=trainer.cfg.optim.betas,
                            weight_decay=trainer.cfg.optim.weight_decay)
    state = {"step": 0}

    def step():
        batch = trainer.batch(state["step"])
        state["step"] += 1
        with autocast(trainer.device, dtype):
            loss = hf_model(input_ids=batch.inputs, labels=batch.inputs).loss
        loss.item()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), trainer.cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def build_hf(cfg):
    """A random LlamaForCausalLM of the same shape as the stemlm model config ``cfg``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                         num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq_len,
                         rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(hf_cfg).train()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="numerics of both sides")
    ap.add_argument("--quick", action="store_true", help="4 x 64 tokens, 2 steps, writes vs_hf.quick.json")
    args = ap.parse_args()
    if args.quick:
        args.batch_size, args.seq_len, args.steps = 4, 64, 2
    vocab = 8192
    overrides = [f"data.dir={synthetic_data_dir(vocab)}", f"data.batch_size={args.batch_size}",
                 f"data.seq_len={args.seq_len}", "model.ffn=dense", f"model.vocab_size={vocab}", "model.d_ff=688",
                 "optim.grad_clip=1.0", f"run.dtype={args.dtype}"]
    trainer = make_trainer(overrides)
    other = "aten" if trainer.matmul_backend == "onednn" else "onednn"  # the GEMMs run.matmul=auto did not pick
    other_trainer = make_trainer([*overrides, f"run.matmul={other}"])
    compiled = make_trainer([*overrides, "run.compile=true"])
    hf_model = build_hf(trainer.model.cfg)
    n_params = (trainer.model.num_parameters(), sum(p.numel() for p in hf_model.parameters()))
    assert n_params[0] == n_params[1], f"shapes differ: {n_params}"
    samples: dict[str, list[float]] = {}
    times = time_interleaved({"stemlm": trainer.train_step, "hf": hf_step_fn(trainer, hf_model, args.dtype),
                              f"stemlm_{other}": other_trainer.train_step, "stemlm_compiled": compiled.train_step},
                             args.steps, samples=samples)
    tokens = args.batch_size * args.seq_len
    tps = {k: tokens / v for k, v in times.items()}
    ratio = paired_ratio(samples["hf"], samples["stemlm"])  # stemlm tokens/s ÷ HF tokens/s, per round
    ratio_medians, ratio_fastest = tps["stemlm"] / tps["hf"], min(samples["hf"]) / min(samples["stemlm"])
    ratio_other = paired_ratio(samples["hf"], samples[f"stemlm_{other}"])
    ratio_compiled = paired_ratio(samples["hf"], samples["stemlm_compiled"])
    print(f"d=256, 6 layers, V={vocab}, {args.batch_size}x{args.seq_len} tokens/step, {n_params[0] / 1e6:.2f}M params, "
          f"{args.dtype}")
    print(f"  stemlm {tps['stemlm']:.0f} tok/s (GEMMs: {trainer.matmul_backend})   HF Llama (sdpa) {tps['hf']:.0f} tok/s "
          f"(medians of {args.steps} steps)")
    print(f"  ratio {ratio:.2f} (median of per-round ratios; goal >= 1.3: {'met' if ratio >= 1.3 else 'not met'})   "
          f"ratio of medians {ratio_medians:.2f}   of fastest steps {ratio_fastest:.2f}")
    for label, key, r in ((f"run.matmul={other}", f"stemlm_{other}", ratio_other),
                           ("run.compile=true", "stemlm_compiled", ratio_compiled)):
        print(f"  stemlm with {label} {tps[key]:.0f} tok/s: ratio {r:.2f} (median of per-round ratios)")
    name = "vs_hf" if args.dtype == "float32" else f"vs_hf_{args.dtype}"
    path = write_result(name, args.quick, {"dtype": args.dtype, "batch_size": args.batch_size, "seq_len": args.seq_len,
                                              "steps": args.steps, "seconds_per_step": times, "tokens_per_s": tps,
                                              "ratio": ratio, "ratio_of_medians": ratio_medians,
                                              "ratio_of_fastest": ratio_fastest, "matmul": trainer.matmul_backend,
                                              f"ratio_{other}": ratio_other, "ratio_compiled": ratio_compiled,
                                              "step_seconds": samples,
                                              "goal_met": ratio >= 1.3})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
