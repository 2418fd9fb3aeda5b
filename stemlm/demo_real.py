"""The real-model demo: SmolLM2-135M turned into STEM with calibrated rows, one fact edited by rows.

``run_real_demo()`` converts the pinned SmolLM2-135M (``stemlm convert --from-hf smollm2 --ffn
stem --init calibrate``; cached, a few minutes the first time), counts the capitals it knows
before any edit, and swaps the table rows of two countries in the STEM layers, printing the
paper's Fig. 5 panels on the training phrasing and on a held-out phrasing. The edit is undone and
the checkpoint never changes. Which placement carries facts in rows is measured in
docs/insertion.md: SmolLM2 writes a country's facts at the country's token in its *first* FFN layer
(activation patching, ``benchmarks/bench_edit_trace.py``), which the paper's placements never
convert; with calibrated STEM rows there (the default placement, layer 0) swapping two countries' rows
moves the capital, while rows at the paper's 1/3 placement carry no facts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

DEFAULT_PLACEMENT = "0"  # the layer whose rows carry the capitals (docs/insertion.md)
DEFAULT_CALIB_TOKENS = 65_536
PROMPTS = ("The capital of {} is", "The capital city of {} is")  # the facts corpus's training and a held-out phrasing


@dataclass
class RealDemoResult:
    """What the real-model demo measured."""

    checkpoint: Path
    placement: list[int]
    known: dict[str, tuple[int, int]] = field(default_factory=dict)  # phrasing -> (known, asked)
    reports: list = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)


def demo_checkpoint(placement: str = DEFAULT_PLACEMENT, calib_tokens: int = DEFAULT_CALIB_TOKENS,
                    progress: bool = True) -> Path:
    """SmolLM2-135M as STEM at ``placement`` with calibrated tables, converted once into the cache."""
    from .insert.calibrate import CalibrationConfig
    from .interop.convert import convert_from_hf
    from .runtime.artifacts import cache_dir

    out = cache_dir() / "demo" / f"smollm2-stem-{placement.replace('/', '_').replace(',', '+')}-{calib_tokens}"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_from_hf("smollm2", out, ffn="stem", stem_layers=placement, init="calibrate",
                        # the demo's measured conversion (no W_d refit, no shrink), whatever convert's default
                        calibration=CalibrationConfig(tokens=calib_tokens, refit_down=False, shrink=0.0),
                        progress=progress, log=print)
    return out


def known_capitals(model, tokenizer, facts: list[dict], split: str) -> tuple[int, int]:
    """``(known, asked)``: capital facts of ``split`` whose first answer token is the model's top-1."""
    from .edit.probes import build_probes
    from .edit.scoring import score

    probes = [p for ps in build_probes(facts, tokenizer, split, ("capital",)).values() for p in ps]
    s = score(model, [p.prompt_ids for p in probes], [p.answer_ids for p in probes])
    return int(s.first_ok.sum()), len(probes)


def run_real_demo(swap: tuple[str, str] = ("Spain", "Germany"), placement: str = DEFAULT_PLACEMENT,
                  calib_tokens: int = DEFAULT_CALIB_TOKENS, out: str | Path = "runs/demo-smollm2",
                  progress: bool = True) -> RealDemoResult:
    """Convert (cached), count the known capitals, swap two countries' rows, draw Fig. 5."""
    from .data import corpus_in_vocabulary, load_facts
    from .edit.load import load_model_and_tokenizer
    from .edit.report import plot_report, swap_report

    ckpt = demo_checkpoint(placement, calib_tokens, progress)
    corpus = corpus_in_vocabulary(ckpt / "tokenizer.json", progress=progress)
    model, tok = load_model_and_tokenizer(ckpt, corpus)
    facts = load_facts(corpus)
    result = RealDemoResult(ckpt, list(model.cfg.table_layers))
    with torch.no_grad():
        for split, label in (("train", PROMPTS[0]), ("heldout_template", "held-out phrasings")):
            result.known[label] = known_capitals(model, tok, facts, split)
    a, b = swap
    out = Path(out)
    for template in PROMPTS:
        report = swap_report(model, tok, template.format(a), a, b, k=5, mode="swap")
        result.reports.append(report)
        result.plots.append(plot_report(report, out / f"demo_swap_{len(result.plots)}.png"))
    return result


def format_real_demo(demo: RealDemoResult) -> str:
    """The printout: known capitals, then the Fig. 5 panels of each phrasing."""
    from .edit.report import format_report

    lines = ["", f"SmolLM2-135M with calibrated STEM rows in layers {', '.join(map(str, demo.placement))}",
             "", "| capital questions | known | asked |", "|---|---:|---:|"]
    lines += [f"| {label} | {k} | {n} |" for label, (k, n) in demo.known.items()]
    for report in demo.reports:
        lines += ["", format_report(report)]
    lines += ["", f"checkpoint: {demo.checkpoint}", "plots: " + ", ".join(map(str, demo.plots)), "",
              "measured over many facts: python benchmarks/bench_edit_real.py --table-layers 0+1/3 (docs/insertion.md):",
              "rows of layer 0 carry SmolLM2's capitals; rows at the paper's 1/3 placement carry none"]
    return "\n".join(lines)
