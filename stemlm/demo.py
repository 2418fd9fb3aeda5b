"""The facts demo: train a small STEM model that knows the country facts, then edit one by rows.

``run_demo()`` trains (or resumes) a debug-sized STEM model on the facts-only corpus with the
editing recipe of docs/editing.md (STEM in every layer but the first, tables at a raised learning
rate, input embedding frozen), measures which facts it recalls, and swaps the table rows of two
countries in every STEM layer, printing the three top-k panels of the paper's Fig. 5 and drawing
them. Nothing is written to the checkpoint by the edit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .data import load_facts, prepare_facts_corpus
from .edit.probes import build_probes
from .edit.report import EditReport, format_report, plot_report, swap_report
from .edit.scoring import score
from .train import load_train_config, train

# The editing recipe (docs/editing.md): facts go into the rows, not into the input embedding.
RECIPE = ["model.ffn=stem", "model.stem_layers=full", "optim.table_lr=0.1", "optim.embed_lr=0",
          "data.batch_size=32", "data.seq_len=64"]
SPLIT_LABELS = {"train": "trained phrasings", "heldout_template": "held-out phrasings",
                "heldout_country": "countries never trained on"}


@dataclass
class DemoResult:
    """What the demo measured: recall per split, the example answers and the edit report."""

    run_dir: Path
    checkpoint: Path
    recall: dict[str, tuple[int, int]] = field(default_factory=dict)  # split -> (known, asked)
    examples: list[tuple[str, str, str]] = field(default_factory=list)  # (prompt, expected, top-1)
    reports: list[EditReport] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)


def demo_config(out: str, steps: int, seed: int = 0, progress: bool = True):
    """The ``TrainConfig`` of the demo run (debug shape, facts corpus, editing recipe)."""
    overrides = RECIPE + [f"run.out={out}", f"run.steps={steps}", f"run.seed={seed}",
        f"run.eval_every={max(1, steps // 4)}", f"run.ckpt_every={steps}", f"run.progress={progress}"]
    cfg = load_train_config("debug", None, overrides)
    cfg.data.dir = str(prepare_facts_corpus(progress=progress))
    return cfg


def recall(model, tokenizer, facts: list[dict], split: str, relation: str = "capital") -> tuple[int, int]:
    """``(known, asked)``: facts of ``split`` whose whole answer greedy decoding reproduces."""
    probes = [p for ps in build_probes(facts, tokenizer, split, (relation,)).values() for p in ps]
    if not probes:
        return 0, 0
    s = score(model, [p.prompt_ids for p in probes], [p.answer_ids for p in probes])
    return int(s.full_ok.sum()), len(probes)


def examples(model, tokenizer, prompts: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """``(prompt, expected, top-1 next token)`` for a few hand-picked questions."""
    from .edit.report import topk

    return [(p, want, topk(model, tokenizer, p, k=1).tokens[0]) for p, want in prompts]


def run_demo(out: str = "runs/demo", steps: int = 1200, swap: tuple[str, str] = ("Spain", "Germany"),
             seed: int = 0, progress: bool = True) -> DemoResult:
    """Train (resuming a finished or interrupted run), measure recall, swap two countries' rows."""
    cfg = demo_config(out, steps, seed, progress)
    result = train(cfg, resume=True)
    from .edit.load import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(result.run_dir)
    facts = load_facts(Path(cfg.data.dir))
    demo = DemoResult(Path(result.run_dir), Path(result.checkpoint))
    with torch.no_grad():
        for split in SPLIT_LABELS:
            demo.recall[split] = recall(model, tok, facts, split)
    a, b = swap
    demo.examples = examples(model, tok, [(f"The capital of {c} is", _capital(facts, c)) for c in (a, b, "France", "Japan")])
    for prompt in (f"The capital of {a} is", f"The seat of power in {a} is the city of"):
        report = swap_report(model, tok, prompt, a, b, k=5, mode="swap")
        demo.reports.append(report)
        demo.plots.append(plot_report(report, demo.run_dir / f"demo_swap_{len(demo.plots)}.png"))
    return demo


def _capital(facts: list[dict], country: str) -> str:
    for f in facts:
        if f["country"] == country and f["relation"] == "capital":
            return f["answer"]
    raise ValueError(f"no capital fact for {country!r} in the facts corpus")


def format_demo(demo: DemoResult) -> str:
    """The demo's printout: recall table, example answers, the Fig. 5 panels, what to try next."""
    lines = ["", "What the model knows (capital of a country; greedy answer equals the fact):",
             "| questions | known | asked | recall |", "|---|---:|---:|---:|"]
    for split, (known, asked) in demo.recall.items():
        lines.append(f"| {SPLIT_LABELS[split]} | {known} | {asked} | {known / max(asked, 1):.1%} |")
    lines += ["", "| prompt | fact | model's next token |", "|---|---|---|"]
    lines += [f"| {p!r} | {want} | {got!r} |" for p, want, got in demo.examples]
    for report in demo.reports:
        lines += ["", format_report(report)]
    ckpt = demo.checkpoint
    lines += ["", f"run: {demo.run_dir}", f"checkpoint: {ckpt}", "plots: " + ", ".join(map(str, demo.plots)), "",
              "try next:",
              f"  stemlm edit --ckpt {demo.run_dir} --swap France=Italy --prompt \"The capital of France is\"",
              f"  stemlm edit-eval --ckpt {demo.run_dir} --split heldout_template",
              f"  stemlm generate --ckpt {demo.run_dir} --prompt \"The official currency of Japan is the\" "
              "--max-new-tokens 4"]
    return "\n".join(lines)
