"""Knowledge edits on STEM tables: swap, copy, inject, forget; each returns an undo record.

An edit rewrites the rows of some token ids in every chosen table layer (``layers=None``: all
of them). Nothing else in the model changes, so a token's edit only affects positions at or
after its first occurrence, and ``record.undo()`` restores the logits bit for bit.

Direction: ``edit(model, source, target)`` makes the *source* entity carry the *target*'s rows
("Spain becomes Germany": prompts about Spain get Germany's answers). ``mode="swap"`` also
gives the target the source's rows. ``copy(model, src_ids, dst_ids)`` writes src's rows into dst.
Unequal lengths are handled by the strategies of ``strategies.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .rows import EMBEDDING, EditRecord, EmbeddingRows, apply_writes, as_ids, collect_writes, num_rows, read, resolve_layers
from .strategies import check_strategy, map_rows, resolve_strategy
from .tokens import describe, entity_ids, eos_id

MODES = ("copy", "swap")
REPLACEMENTS = ("mean", "zero")
_CHUNK = 4096


def resolve_filler(filler: int | str | None, tokenizer, vocab: int) -> int:
    """Filler token id: an id, a token string (one token, taken verbatim), or the EOS token."""
    if filler is None:
        if tokenizer is None:
            raise ValueError("strategy 'filler' needs filler=<token id> when no tokenizer is given")
        filler = eos_id(tokenizer)
    if isinstance(filler, str):
        ids = entity_ids(tokenizer, filler, vocab, leading_space=False)
        if len(ids) != 1:
            raise ValueError(f"filler {filler!r} must be a single token, got {len(ids)}: {describe(tokenizer, ids)}")
        filler = ids[0]
    return int(as_ids([filler], vocab, "filler")[0])


def _assignments(model, layer: int, src: torch.Tensor, tgt: torch.Tensor, strategy: str, align: str,
                 filler: int | None, keep: frozenset[int] = frozenset()) -> list[tuple[int, torch.Tensor]]:
    """``(id, row)`` pairs giving each source id its row from the target (one layer); ids in ``keep``
    keep their rows."""
    rows = read(model, layer, tgt)  # (m, d_ff)
    filler_row = read(model, layer, torch.tensor([filler]))[0] if filler is not None else None
    new = map_rows(rows, len(src), strategy, align, filler_row)  # (n, d_ff)
    return [(int(t), new[k]) for k, t in enumerate(src) if int(t) not in keep]


def plan(model, source_ids: Sequence[int], target_ids: Sequence[int], *, strategy: str = "auto",
         layers: Sequence[int] | None = None, mode: str = "copy", align: str = "left",
         filler_id: int | None = None, embedding: bool = False,
         keep: Sequence[int] = ()) -> dict[int | str, tuple[torch.Tensor, torch.Tensor]]:
    """The rows an edit would write, ``{layer: (ids, rows)}``; validates everything, writes nothing.

    ``keep``: token ids whose rows are left as they are even where the entities hold them (e.g.
    subwords that other names share: an edit then touches no prompt without the edited names).

    ``embedding=True`` also rewrites the input-embedding rows the same way (key ``"embedding"``):
    a diagnostic of how much of the entity the embedding carries, not a STEM edit.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    check_strategy(strategy, align)
    embedding_only = embedding and layers is not None and len(layers) == 0  # layers=[]: the embedding alone
    chosen: list[int | str] = [] if embedding_only else list(resolve_layers(model, layers))
    if embedding:
        EmbeddingRows(model)  # raises for tied embeddings
        chosen.append(EMBEDDING)
    vocab = model.cfg.vocab_size if embedding_only else num_rows(model)
    src, tgt = as_ids(source_ids, vocab, "source ids"), as_ids(target_ids, vocab, "target ids")
    concrete = [resolve_strategy(strategy, len(src), len(tgt))]
    if mode == "swap":
        concrete.append(resolve_strategy(strategy, len(tgt), len(src)))
    if "filler" in concrete and len(src) != len(tgt) and filler_id is None:
        raise ValueError("strategy 'filler' needs a filler token (filler=...)")
    kept = frozenset(int(t) for t in keep)
    writes = {}
    for layer in chosen:
        pairs = _assignments(model, layer, src, tgt, strategy, align, filler_id, kept)
        if mode == "swap":
            pairs += _assignments(model, layer, tgt, src, strategy, align, filler_id, kept)
        if pairs:
            writes[layer] = collect_writes(pairs)
    return writes


def edit(model, source: str | Sequence[int], target: str | Sequence[int], *, strategy: str = "auto",
         layers: Sequence[int] | None = None, mode: str = "copy", align: str = "left",
         filler: int | str | None = None, tokenizer=None, leading_space: bool = True,
         embedding: bool = False, keep: Sequence[int] = ()) -> EditRecord:
    """Give ``source`` the table rows of ``target`` (both ways with ``mode="swap"``).

    ``keep``: token ids whose rows are not written (see ``plan``).

    ``source``/``target`` are entity strings (tokenized with ``tokenizer``, leading space added,
    see ``tokens.entity_ids``) or token-id lists. Returns an ``EditRecord`` (also a context
    manager). Any bad input raises before a single row is written. ``embedding=True`` edits the
    input-embedding rows too (diagnostic, see ``plan``).
    """
    vocab = num_rows(model)
    src = entity_ids(tokenizer, source, vocab, leading_space)
    tgt = entity_ids(tokenizer, target, vocab, leading_space)
    check_strategy(strategy, align)
    needs_filler = strategy == "filler" and len(src) != len(tgt)
    filler_id = resolve_filler(filler, tokenizer, vocab) if needs_filler else None
    writes = plan(model, src, tgt, strategy=strategy, layers=layers, mode=mode, align=align, filler_id=filler_id,
                  embedding=embedding, keep=keep)
    arrow = "<->" if mode == "swap" else "<-"
    desc = f"{describe(tokenizer, src)} {arrow} {describe(tokenizer, tgt)} [{strategy}{' +embedding' if embedding else ''}]"
    return apply_writes(model, writes, desc)


def swap(model, a_ids: str | Sequence[int], b_ids: str | Sequence[int], *, layers: Sequence[int] | None = None,
         strategy: str = "auto", **kwargs) -> EditRecord:
    """Exchange the rows of two entities in the chosen table layers."""
    return edit(model, a_ids, b_ids, strategy=strategy, layers=layers, mode="swap", **kwargs)


def copy(model, src_ids: str | Sequence[int], dst_ids: str | Sequence[int], *, layers: Sequence[int] | None = None,
         strategy: str = "auto", **kwargs) -> EditRecord:
    """Write the rows of ``src_ids`` into ``dst_ids`` (dst takes src's knowledge; src unchanged)."""
    return edit(model, dst_ids, src_ids, strategy=strategy, layers=layers, mode="copy", **kwargs)


def inject(model, new: str | Sequence[int], known: str | Sequence[int], **kwargs) -> EditRecord:
    """Knowledge injection: a new (rare, unused) token takes the rows of a known entity."""
    return edit(model, new, known, mode="copy", **kwargs)


def mean_row(model, layer: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Mean table row of a layer over ``ids`` (default: the whole table, read in chunks)."""
    if ids is not None:
        return read(model, layer, ids).float().mean(dim=0)
    total, n = None, num_rows(model)
    for start in range(0, n, _CHUNK):
        part = read(model, layer, torch.arange(start, min(start + _CHUNK, n))).float().sum(dim=0)
        total = part if total is None else total + part
    return total / n


def forget(model, entity: str | Sequence[int], *, replacement: str | Sequence[int] = "mean",
           layers: Sequence[int] | None = None, tokenizer=None, leading_space: bool = True) -> EditRecord:
    """Fact removal: overwrite an entity's rows with a neutral row in every chosen layer.

    ``replacement``: ``"mean"`` (the table's mean row), ``"zero"``, or a token string / id list
    whose mean row is used (e.g. other entities of the same kind, or a neutral word).
    """
    chosen = resolve_layers(model, layers)
    vocab = num_rows(model)
    ids = as_ids(entity_ids(tokenizer, entity, vocab, leading_space), vocab, "entity ids")
    ref = None
    if not (isinstance(replacement, str) and replacement in REPLACEMENTS):
        ref = as_ids(entity_ids(tokenizer, replacement, vocab, leading_space), vocab, "replacement ids")
    writes = {}
    for layer in chosen:
        old = read(model, layer, ids)
        if replacement == "zero":
            row = torch.zeros(old.shape[1], dtype=old.dtype)
        else:
            row = mean_row(model, layer, ref).to(old.dtype)
        uniq = torch.unique(ids)
        writes[layer] = (uniq, row.expand(len(uniq), -1).clone())
    return apply_writes(model, writes, f"forget {describe(tokenizer, ids.tolist())} [{replacement}]")
