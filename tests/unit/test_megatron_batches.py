"""Ranks of one model-parallel group join their shards of a batch (gloo, two processes): both
compute on the same rows, in rank order, and each answers for the rows it was given."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.data.batch import TrainBatch
from tandem.trainer.megatron_batches import concatenate, join_model_parallel


def shard(rank: int) -> TrainBatch:
    rows, width = 2 + rank, 5 + 2 * rank  # shards of different sizes and widths
    ids = torch.arange(rows * width).reshape(rows, width) + 100 * rank
    mask = torch.ones(rows, width)
    return TrainBatch(ids, torch.ones_like(ids), mask, advantages=mask * (rank + 1))


def _rank_main(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        joined, mine = join_model_parallel(shard(rank), dist.group.WORLD)
        results[rank] = (joined, mine)
    finally:
        dist.destroy_process_group()


def test_group_members_join_their_shards_in_rank_order() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(port, results), nprocs=2, join=True)
    (joined0, rows0), (joined1, rows1) = results[0], results[1]
    assert torch.equal(joined0.input_ids, joined1.input_ids)
    assert (rows0, rows1) == (slice(0, 2), slice(2, 5))
    for rank, rows in ((0, rows0), (1, rows1)):
        expected = shard(rank)
        width = expected.input_ids.shape[1]
        assert torch.equal(joined0.input_ids[rows, :width], expected.input_ids)
        assert joined0.advantages is not None and expected.advantages is not None
        assert torch.equal(joined0.advantages[rows, :width], expected.advantages)
        assert not joined0.attention_mask[rows, width:].any()  # padding is no token
        assert not joined0.loss_mask[rows, width:].any()


def test_one_rank_groups_keep_the_batch() -> None:
    batch = shard(1)
    joined, rows = join_model_parallel(batch, None)
    assert joined is batch and rows == slice(0, 3)


def test_concatenate_skips_fields_some_batches_lack() -> None:
    a, b = shard(0), shard(1)
    b.advantages = None
    joined = concatenate([a, b])
    assert joined.advantages is None and joined.input_ids.shape == (5, 7)
