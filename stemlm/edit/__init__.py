"""Knowledge editing on STEM tables (see docs/editing.md); ``ngram_edit`` rewrites one n-gram's
hashed rows in the n-gram layers (``stemlm.edit.ngram``).

Every edit rewrites rows of token-indexed tables through the table protocol, returns an
``EditRecord`` that restores them exactly, and works as a context manager::

    from stemlm.edit import swap
    with swap(model, " Spain", " Germany", tokenizer=tok):
        ...  # prompts about Spain now get Germany's answers
"""

from .ngram import NgramEdit, ngram_edit, ngram_swap, plan_ngram_edit
from .ops import copy, edit, forget, inject, mean_row, plan, swap
from .rows import EditRecord, resolve_layers, table_layers, undo_all
from .strategies import ALIGNS, STRATEGIES, map_rows, source_index_map
from .tokens import entity_ids, eos_id

__all__ = ["ALIGNS", "EditRecord", "NgramEdit", "STRATEGIES", "copy", "edit", "entity_ids", "eos_id", "forget", "inject",
           "map_rows", "mean_row", "ngram_edit", "ngram_swap", "plan", "plan_ngram_edit", "resolve_layers",
           "source_index_map", "swap", "table_layers", "undo_all"]
