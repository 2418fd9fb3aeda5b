"""ShardedTable on a real 2-process gloo group equals the full in-memory table."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stemlm.model.tables import Tables
from stemlm.train.distributed.sharded_table import ShardedTable

V, D = 37, 6


def _worker(rank, world, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    full = torch.randn(V, D, generator=torch.Generator().manual_seed(0))
    table = ShardedTable.from_full(full, rank, world)
    tables = Tables({"0": table})
    ids = torch.tensor([[3, 5, 3, 36], [0, 5, 9, 9]]) if rank == 0 else torch.tensor([[5, 8, 8, 1], [2, 2, 30, 3]])
    rows = tables.rows(ids)["0"]
    weights = torch.arange(rows.numel(), dtype=torch.float32).view_as(rows) / 100 + rank
    (rows * weights).sum().backward()
    touched = [table.own_grad(union, leaf) for union, leaf in tables.take_step().of("0")]
    result = {"rows": rows.detach(), "touched": touched, "full": table.gather_full()}
    torch.save(result, f"{out_file}.{rank}")
    dist.destroy_process_group()


def test_sharded_lookup_and_gradients_match_full_table(tmp_path):
    world = 2
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=world, join=True)
    full = torch.randn(V, D, generator=torch.Generator().manual_seed(0))
    ids = [torch.tensor([[3, 5, 3, 36], [0, 5, 9, 9]]), torch.tensor([[5, 8, 8, 1], [2, 2, 30, 3]])]
    expected_grad = torch.zeros(V, D)
    for rank in range(world):
        res = torch.load(tmp_path / f"out.{rank}", weights_only=True)
        torch.testing.assert_close(res["rows"], full[ids[rank]])
        torch.testing.assert_close(res["full"], full)
        weights = torch.arange(res["rows"].numel(), dtype=torch.float32).view_as(res["rows"]) / 100 + rank
        expected_grad.index_put_((ids[rank].reshape(-1),), weights.reshape(-1, D), accumulate=True)
    expected_grad /= world
    seen = set()
    for rank in range(world):
        res = torch.load(tmp_path / f"out.{rank}", weights_only=True)
        for local_ids, grad in res["touched"]:
            global_ids = local_ids * world + rank
            torch.testing.assert_close(grad, expected_grad[global_ids])
            seen.update(global_ids.tolist())
    assert seen == set(torch.cat([i.reshape(-1) for i in ids]).tolist())
