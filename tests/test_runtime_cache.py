"""stemlm.runtime.cache: a measurement is computed once per key, read back after, and a damaged, foreign or
unwritable cache file is measured again rather than an error."""

import json

import pytest

from stemlm.runtime.cache import cached_json


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STEMLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "things"


def test_computed_once_per_key_then_read_back(cache):
    calls = []

    def compute(v):
        calls.append(v)
        return {"value": v}

    assert cached_json("things", "a", lambda: compute(1)) == ({"value": 1}, False)
    assert cached_json("things", "a", lambda: compute(2)) == ({"value": 1}, True)
    assert cached_json("things", "b", lambda: compute(3)) == ({"value": 3}, False)
    assert calls == [1, 3] and len(list(cache.glob("*.json"))) == 2


def test_damaged_invalid_or_foreign_files_are_measured_again(cache):
    cached_json("things", "a", lambda: [1.0, 2.0])
    (path,) = cache.glob("*.json")
    path.write_text("{ not json")
    assert cached_json("things", "a", lambda: [3.0]) == ([3.0], False)
    path.write_text(json.dumps({"key": "another key", "value": [9.0]}))  # a digest collision or a hand edit
    assert cached_json("things", "a", lambda: [4.0]) == ([4.0], False)
    assert cached_json("things", "a", lambda: [5.0], valid=lambda v: v == [5.0]) == ([5.0], False)  # [4.0] refused


def test_an_unwritable_cache_still_returns_the_measurement(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("STEMLM_CACHE", str(blocker))
    assert cached_json("things", "a", lambda: 7) == (7, False)
