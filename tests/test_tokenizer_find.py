"""``find_tokenizer``: one search for a checkpoint's tokenizer, with the order each caller needs."""

import pytest
from transformers import PreTrainedTokenizerFast

from stemlm.data.tokenizer import find_tokenizer, run_places, train_bpe

TEXTS = ["the cat sat on the mat", "a dog ran in the park"] * 20


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """A directory with stemlm's ``tokenizer.json`` and the Hugging Face files of the same tokenizer."""
    where = tmp_path_factory.mktemp("both")
    tok = train_bpe(TEXTS, vocab_size=300)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(where)
    return where


def test_each_preference_picks_its_format(both):
    stem = find_tokenizer(both)
    assert not stem.hf and stem.files == (both / "tokenizer.json",)
    for prefer in ("hf", "transformers"):
        hf = find_tokenizer(both, prefer=prefer)
        assert hf.hf and both / "tokenizer_config.json" in hf.files
        assert hf.tokenizer.encode("the cat", add_special_tokens=False) == stem.tokenizer.encode("the cat").ids


def test_a_file_is_read_by_stemlm_and_empty_places_are_passed_over(both, tmp_path):
    found = find_tokenizer(None, tmp_path, both / "tokenizer.json", prefer="hf")
    assert not found.hf and found.files == (both / "tokenizer.json",)


def test_checkpoint_then_its_run(both, tmp_path):
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000010"
    ckpt.mkdir(parents=True)
    (tmp_path / "run" / "tokenizer.json").write_bytes((both / "tokenizer.json").read_bytes())
    assert run_places(ckpt) == (ckpt, tmp_path / "run")
    assert find_tokenizer(*run_places(ckpt)).files == (tmp_path / "run" / "tokenizer.json",)


def test_missing_tokenizer_names_the_places_and_the_hint(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no tokenizer in {tmp_path} .*; pass --data DIR"):
        find_tokenizer(tmp_path, hint="pass --data DIR")
    with pytest.raises(ValueError, match="unknown tokenizer preference"):
        find_tokenizer(tmp_path, prefer="fast")
