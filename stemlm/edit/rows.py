"""Row access for editing: which table layers to touch, id validation, and undoable writes.

Everything here talks to tables only through the table protocol (``model.tables[str(layer)]``
with ``read_rows(ids)``, ``write_rows(ids, rows)``, ``num_rows``, ``dim``), so an edit works the
same on every storage tier (in-memory parameter, host RAM, disk, a cache in front of them).

An edit is applied in two phases: every new row is computed and every input validated first,
then rows are written. A failure before the write phase leaves the model untouched; a failure
during it rolls back the layers already written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch


def table_layers(model) -> list[int]:
    """Sorted layer indices that own a table; a clear error when there is none."""
    tables = getattr(model, "tables", None)
    if tables is None or len(tables) == 0:
        kind = getattr(getattr(model, "cfg", None), "ffn", "?")
        raise ValueError(f"model has no table layers (ffn={kind!r}); knowledge editing needs STEM tables")
    return sorted(int(k) for k in tables.keys())


def resolve_layers(model, layers: Iterable[int] | None = None) -> list[int]:
    """``None`` -> every table layer; otherwise check each index is a table layer of the model."""
    available = table_layers(model)
    if layers is None:
        return available
    chosen = [int(i) for i in layers]
    if not chosen:
        raise ValueError("layers is empty; pass None for every table layer")
    n_layers = len(model.layers) if hasattr(model, "layers") else max(available) + 1
    for i in chosen:
        if not 0 <= i < n_layers:
            raise IndexError(f"layer {i} out of range for a {n_layers}-layer model (valid 0..{n_layers - 1})")
        if i not in available:
            raise ValueError(f"layer {i} has no table; table layers are {', '.join(map(str, available))}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"duplicate layer in {chosen}")
    return sorted(chosen)


def as_ids(ids: Sequence[int] | torch.Tensor, num_rows: int, what: str = "token ids") -> torch.Tensor:
    """A 1-D LongTensor of ids, checked against ``[0, num_rows)``; empty lists are errors."""
    t = torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids, dtype=torch.long).reshape(-1)
    if t.numel() == 0:
        raise ValueError(f"{what} are empty")
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= num_rows:
        bad = lo if lo < 0 else hi
        raise IndexError(f"{what}: token id {bad} out of range for a vocabulary of {num_rows} (valid 0..{num_rows - 1})")
    return t


def num_rows(model) -> int:
    """The token ids a token edit may name: the vocabulary (an n-gram table's rows past it are hashed slots,
    ``stemlm.edit.ngram`` edits those)."""
    return min(int(model.cfg.vocab_size), int(model.tables[str(table_layers(model)[0])].num_rows))


EMBEDDING = "embedding"  # the input embedding, editable as a diagnostic next to the tables


class EmbeddingRows:
    """The input embedding seen through the table protocol (``edit(..., embedding=True)``).

    Not a STEM edit: it measures how much of an entity's identity the embedding holds.
    """

    def __init__(self, model):
        if getattr(model.cfg, "tie_embeddings", False):
            raise ValueError("embedding=True on a model with tied embeddings would also edit the LM head")
        self.weight = model.tok_embeddings.weight
        self.num_rows, self.dim = self.weight.shape

    def read_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.detach()[ids].clone()

    @torch.no_grad()
    def write_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.weight[ids] = rows.to(self.weight.dtype)


def rows_of(model, layer: int | str):
    """The row store of a table layer, or of the input embedding for ``EMBEDDING``."""
    return EmbeddingRows(model) if layer == EMBEDDING else model.tables[str(layer)]


def read(model, layer: int | str, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``(len(ids), dim)`` of one layer's table (or of the embedding), on the CPU."""
    return rows_of(model, layer).read_rows(ids).detach().to("cpu")


@dataclass
class EditRecord:
    """What an edit overwrote: ``old[layer] = (ids, rows)``; ``undo()`` writes the rows back.

    Used as a context manager the edit is undone on exit::

        with swap(model, a, b):
            logits = model(ids)      # edited
        # model restored bit for bit
    """

    model: object
    old: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    description: str = ""
    undone: bool = False
    info: dict = field(default_factory=dict)  # what the edit's planner reports beside the rows (n-gram edits)

    @property
    def layers(self) -> list[int | str]:
        """Layers the edit touched (``"embedding"`` last when the embedding was edited too)."""
        return sorted(k for k in self.old if k != EMBEDDING) + [k for k in self.old if k == EMBEDDING]

    def undo(self) -> None:
        """Restore every overwritten row exactly; a second call does nothing."""
        if self.undone:
            return
        for layer in reversed(self.layers):
            ids, rows = self.old[layer]
            rows_of(self.model, layer).write_rows(ids, rows)
        self.undone = True

    def __enter__(self) -> "EditRecord":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        n = sum(len(ids) for ids, _ in self.old.values())
        state = "undone" if self.undone else "applied"
        return f"EditRecord({self.description!r}, layers={self.layers}, rows={n}, {state})"


def collect_writes(assignments: Iterable[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``(id, row)`` assignments into ``(ids, rows)``; drop duplicates that agree.

    Two different rows for one id (e.g. a swap whose sides share a token under a strategy that
    gives it two meanings) is an error, raised before anything is written.
    """
    merged: dict[int, torch.Tensor] = {}
    for tid, row in assignments:
        if tid in merged and not torch.equal(merged[tid], row):
            raise ValueError(f"token id {tid} would receive two different rows (it occurs on both sides of the "
                             "edit); use a strategy that aligns shared tokens one to one, or edit one way")
        merged[tid] = row
    ids = torch.tensor(sorted(merged), dtype=torch.long)
    return ids, torch.stack([merged[i] for i in ids.tolist()])


def apply_writes(model, writes: dict[int | str, tuple[torch.Tensor, torch.Tensor]], description: str = "") -> EditRecord:
    """Write ``writes[layer] = (ids, rows)`` into the tables and return the undo record.

    Old rows are read for every layer before the first write; if a write raises, the layers
    already written are restored and the error re-raised, so the model is never half edited.
    """
    record = EditRecord(model, description=description)
    old = {layer: (ids, read(model, layer, ids)) for layer, (ids, _) in writes.items()}
    for layer, (ids, rows) in writes.items():
        try:
            rows_of(model, layer).write_rows(ids, rows)
        except BaseException:
            with contextlib.suppress(Exception):  # the failed write may have been partial
                rows_of(model, layer).write_rows(*old[layer])
            record.undo()
            raise
        record.old[layer] = old[layer]
    return record


def undo_all(records: Sequence[EditRecord]) -> None:
    """Undo several edits, newest first (rows touched by more than one edit end at the oldest value)."""
    for record in reversed(list(records)):
        record.undo()
