"""A short soak of the server (benchmarks/soak_serve.py): concurrent clients, a share of them bad, oversized
or abandoned; afterwards no slot is left, every admitted request finished, none was lost, memory is flat."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak_serve  # noqa: E402


def test_soak_leaves_no_slot_and_loses_no_request(tmp_path):
    served = soak_serve.build_server(tmp_path, clients=8)
    r = soak_serve.served_soak(served, clients=8, seconds=6.0, max_requests=400)  # as `stemlm serve` runs
    served.store.close()
    assert r["lost"] == 0, r["lost_examples"]
    assert r["engine_idle"] and r["slots_left"] == 0 and r["admitted_not_finished"] == 0
    kinds = {k.split()[0] for k in r["answers"]}
    assert {"ok", "bad", "oversized", "abandoned"} <= kinds and r["answers"].get("ok 200", 0) > 0
    assert r["rss_mb"]["end"] - r["rss_mb"]["start"] < 100  # flat: no per-request leak
