"""Edit report (paper Fig. 5): top-k next-token probabilities before and after an edit.

Three panels: the original model on the original prompt ("The capital of Spain is"), the
original model on the target-entity prompt ("The capital of Germany is"), and the edited model
on the original prompt. A successful edit makes the third panel look like the second.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from collections.abc import Callable
from pathlib import Path

import torch

from ..runtime.plotting import pyplot, save
from .ops import edit
from .rows import EditRecord
from ..data.codec import TextCodec
from .tokens import contains, encode_prompt, entity_ids


@dataclass
class TopK:
    """Top-k next tokens of one (model, prompt) pair."""

    label: str
    prompt: str
    tokens: list[str]
    ids: list[int]
    probs: list[float]


@dataclass
class EditReport:
    """The three panels plus what was edited."""

    edit: str
    layers: list[int]
    panels: list[TopK] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)  # the edit's own report (``EditRecord.info``: n-gram edits)

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def next_token_probs(model, ids: list[int]) -> torch.Tensor:
    """Next-token distribution ``(V,)`` after the prompt ids."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([ids], device=device))[0, -1]  # (V,)
    return torch.softmax(logits.float(), dim=-1).cpu()


def topk(model, tokenizer, prompt: str, k: int = 5, label: str = "") -> TopK:
    """Top-k next tokens of ``prompt`` (EOS-led, like the training documents)."""
    probs = next_token_probs(model, encode_prompt(tokenizer, prompt))
    p, idx = probs.topk(k)
    ids = idx.tolist()
    codec = TextCodec.of(tokenizer)
    return TopK(label, prompt, [codec.token_text(i) for i in ids], ids, [float(x) for x in p])


def replace_entity(prompt: str, source: str, target: str) -> str:
    """The prompt with the source entity replaced by the target entity."""
    if source.strip() not in prompt:
        raise ValueError(f"the prompt {prompt!r} does not mention the source entity {source.strip()!r}")
    return prompt.replace(source.strip(), target.strip())


def edit_report(model, tokenizer, prompt: str, apply: Callable[[], EditRecord], *, k: int = 5,
                target_prompt: str | None = None, source: str | None = None) -> EditReport:
    """Top-k before/after the edit made by ``apply()`` (undone before returning).

    ``target_prompt`` adds the middle panel (the original model on the target entity's prompt);
    ``source`` (an entity string) enables a warning when the prompt does not contain its tokens.
    """
    if k < 1:
        raise ValueError(f"top-k must be >= 1, got {k}")
    warnings = []
    if source is not None and not contains(encode_prompt(tokenizer, prompt), entity_ids(tokenizer, source, model.cfg.vocab_size)):
        warnings.append(f"the prompt's tokens do not contain those of {source.strip()!r}; "
                        "the edit cannot change this prompt (check spacing/casing)")
    panels = [topk(model, tokenizer, prompt, k, "original model, original prompt")]
    if target_prompt is not None:
        panels.append(topk(model, tokenizer, target_prompt, k, "original model, target prompt"))
    with apply() as record:
        panels.append(topk(model, tokenizer, prompt, k, "edited model, original prompt"))
    return EditReport(record.description, record.layers, panels, warnings, dict(record.info))


def swap_report(model, tokenizer, prompt: str, source: str, target: str, *, k: int = 5, **edit_kwargs) -> EditReport:
    """Fig. 5: ``source`` edited towards ``target`` (``edit_kwargs`` go to ``ops.edit``: mode, strategy,
    layers, align, filler), with the target-entity prompt as the middle panel."""
    return edit_report(model, tokenizer, prompt, lambda: edit(model, source, target, tokenizer=tokenizer, **edit_kwargs),
                       k=k, target_prompt=replace_entity(prompt, source, target), source=source)


def ngram_report(model, tokenizer, prompt: str, source: str, target: str, *, k: int = 5, **edit_kwargs) -> EditReport:
    """Fig. 5 for an n-gram edit (``edit.ngram.ngram_edit``; ``edit_kwargs``: mode, layers, orders,
    leading_space): the target n-gram's prompt as the middle panel, the plan in ``details``."""
    from .ngram import ngram_edit

    return edit_report(model, tokenizer, prompt,
                       lambda: ngram_edit(model, source, target, tokenizer=tokenizer, **edit_kwargs),
                       k=k, target_prompt=replace_entity(prompt, source, target), source=source)


def format_report(report: EditReport) -> str:
    """Markdown tables, one per panel."""
    lines = [f"edit: {report.edit}  (layers {', '.join(map(str, report.layers))})"]
    lines += [f"warning: {w}" for w in report.warnings]
    lines += [f"note: {n}" for n in report.details.get("notes", [])]
    for panel in report.panels:
        lines += ["", f"{panel.label}: {panel.prompt!r}", "| rank | token | prob |", "|---:|---|---:|"]
        lines += [f"| {r + 1} | {t!r} | {p:.4f} |" for r, (t, p) in enumerate(zip(panel.tokens, panel.probs))]
    return "\n".join(lines)


def plot_report(report: EditReport, path: str | Path) -> Path:
    """Bar chart PNG of the three panels (matplotlib Agg, no display needed)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(report.panels), figsize=(4.2 * len(report.panels), 3.4), sharey=True,
                             squeeze=False)
    axes = axes[0]
    for ax, panel in zip(axes, report.panels):
        ax.bar(range(len(panel.probs)), panel.probs, color="#4C72B0")
        ax.set_xticks(range(len(panel.tokens)), [repr(t)[1:-1] for t in panel.tokens], rotation=45, ha="right")
        ax.set_title(f"{panel.label}\n{panel.prompt!r}", fontsize=8)
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("next-token probability")
    fig.suptitle(report.edit, fontsize=9)
    return save(fig, path)
