"""Batched generation: each request decodes as it would alone; finished rows leave; rows fetched once per step."""

import pytest
import torch

from stemlm import StemLM, model_config
from stemlm.inference.batch_generate import SamplingParams, decode_batch, generate_batch
from stemlm.inference.generate import generate
from stemlm.store import Placement, offload_tables


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return StemLM(model_config("debug", ffn="stem", stem_layers="1/2")).eval()


def prompts(lengths=(3, 9, 1, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def alone(model, prompt, sp):
    """The tokens of one prompt decoded by the single-prompt ``generate``."""
    toks = generate(model, torch.tensor([prompt]), sp.max_new_tokens, sp.temperature, sp.top_k, sp.top_p, sp.seed)
    return [int(t[0]) for t in toks]


def test_greedy_batch_equals_each_prompt_alone(model):
    ps = prompts()
    got = generate_batch(model, ps, SamplingParams(max_new_tokens=7))
    assert got == [alone(model, p, SamplingParams(7)) for p in ps]


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    ps = prompts()
    params = [SamplingParams(6, temperature=0.9, top_k=50, seed=1), SamplingParams(6),
              SamplingParams(6, temperature=1.3, top_p=0.9, seed=2), SamplingParams(4, temperature=1.0, seed=3)]
    batched = generate_batch(model, ps, params)
    assert batched == [generate_batch(model, [p], sp)[0] for p, sp in zip(ps, params)]
    assert batched[0] == alone(model, ps[0], params[0])  # the same generator stream as generate()
    reseeded = generate_batch(model, ps, [SamplingParams(6, 0.9, 50, seed=9), *params[1:]])
    assert reseeded[0] != batched[0] and reseeded[1:] == batched[1:]  # other requests are unaffected


def test_rows_leave_at_eos_and_at_their_own_budget(model):
    ps = prompts()
    free = generate_batch(model, ps, SamplingParams(6))
    eos = free[1][2]
    budgets = [SamplingParams(n) for n in (2, 6, 0, 5)]
    steps = list(decode_batch(model, ps, budgets, eos_id=eos))
    got = generate_batch(model, ps, budgets, eos_id=eos)
    for i, toks in enumerate(got):
        cut = free[i][:budgets[i].max_new_tokens]
        want = cut[:cut.index(eos) + 1] if eos in cut else cut
        assert toks == want
    assert [s.requests for s in steps] == [[i for i in range(4) if len(got[i]) > k] for k in range(len(steps))]
    assert got[2] == [] and 2 not in steps[0].requests  # a zero budget never enters the batch


def test_stop_callback_ends_a_request(model):
    ps = prompts()
    free = generate_batch(model, ps, SamplingParams(5))
    got = generate_batch(model, ps, SamplingParams(5), stop=lambda i, toks: i == 0 and len(toks) == 2)
    assert got == [free[0][:2], *free[1:]]


def test_bad_arguments_are_clear_errors(model):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        decode_batch(model, [[1], []], SamplingParams())
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        decode_batch(model, [[1]], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(-1)
    with pytest.raises(ValueError, match="max_seq_len"):
        decode_batch(model, [[1] * (model.cfg.max_seq_len + 1)], SamplingParams())


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_offloaded_batch_fetches_each_distinct_row_once_per_step(tier, tmp_path):
    torch.manual_seed(0)
    model = StemLM(model_config("debug", ffn="stem", stem_layers="1/2")).eval()
    ps = [[5, 6, 5, 7], [5, 6], [9, 5, 6, 5, 5, 8]]
    want = generate_batch(model, ps, SamplingParams(5))
    tables_file = tmp_path / "t.safetensors" if tier == "disk" else None
    with offload_tables(model, Placement(tier, tables_file=tables_file)) as store:
        n_tables = len(store)
        store.reset_stats()
        steps = list(decode_batch(model, ps, SamplingParams(5)))
        stats = store.stats()
        assert generate_batch(model, ps, SamplingParams(5)) == want  # same tokens on any tier
    # {5, 6, 7, 8, 9}: the prompts of 4 and 2 tokens packed into one row of 6, so no padding id is looked up
    assert steps[0].rows == 5 and steps[0].request_rows == 3 + 2 + 4
    assert all(s.rows <= s.request_rows for s in steps)
    assert stats["lookups"] == n_tables * len(steps)  # one lookup per table per step, for the whole batch
    assert stats["unique_rows"] == n_tables * sum(s.rows for s in steps)
    assert stats["prefetched"] == stats["lookups"]  # every step's rows were prefetched


def test_each_request_stops_when_its_own_positions_run_out(model):
    L = model.cfg.max_seq_len
    ps = prompts((L - 2, 5, L))
    got = generate_batch(model, ps, SamplingParams(10))
    assert [len(g) for g in got] == [3, 10, 1]  # the last token of a full row is never fed back
    assert got == [alone(model, p, SamplingParams(10)) for p in ps]
