"""Data: the default offline corpus, the tokenizer, flat token files and deterministic batches.

See docs/data.md. ``prepare_default_corpus()`` builds the default data dir once;
``TokenDataset.open(dir, split)`` + ``get_batch(ds, step, ...)`` feed training.
"""

from .corpus import (corpus_in_vocabulary, data_info, default_data_dir, facts_corpus_dir, is_complete, looks_prepared, prepare_corpus,
                     prepare_default_corpus, prepare_facts_corpus, prepare_user_data)
from .facts import load_facts
from .tokenizer import EOS_TOKEN, PAD_TOKEN, load_tokenizer, train_bpe
from .tokens import Batch, TokenDataset, count_eval_batches, get_batch, iter_eval_batches, read_meta, write_token_split

__all__ = ["EOS_TOKEN", "corpus_in_vocabulary", "PAD_TOKEN", "Batch", "TokenDataset", "count_eval_batches", "data_info", "default_data_dir", "facts_corpus_dir", "get_batch", "is_complete",
           "iter_eval_batches", "load_facts", "load_tokenizer", "looks_prepared", "prepare_corpus", "prepare_default_corpus",
           "prepare_facts_corpus", "prepare_user_data", "read_meta",
           "train_bpe", "write_token_split"]
