"""The plain-torch parts of the Megatron trainer: logprobs over a split (and padded)
vocabulary, and the storage offload that keeps every tensor object."""

from __future__ import annotations

import threading

import torch

from tandem.tensors.storage_offload import StorageOffload, attribute_tensors, copy_runs
from tandem.trainer.vocab_parallel import token_logprobs


def test_logprobs_and_entropy_match_log_softmax_with_padded_vocabulary() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 9, (2, 5))
    lp, ent = token_logprobs(logits, targets, vocab_size=9, with_entropy=True)
    ref_logits = logits[..., :9].float()
    log_p = ref_logits.log_softmax(-1)
    ref_lp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-6)
    assert ent is not None
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-6)
    (lp.sum() + ent.sum()).backward()
    grad = logits.grad
    assert grad is not None and torch.all(grad[..., 9:] == 0)  # padded columns get nothing
    ref = torch.autograd.grad((ref_lp.sum() + ref_ent.sum()), logits)[0]
    torch.testing.assert_close(grad.float(), ref.float(), rtol=0, atol=1e-6)


def test_two_ranks_of_a_split_vocabulary_give_the_full_values() -> None:
    """Two "ranks" (threads) each hold half the columns; their reductions meet at a barrier
    (sum: forward the total, backward the identity, as Megatron's). Each rank's values and
    its columns' gradients equal the unsplit computation's."""
    torch.manual_seed(1)
    full = torch.randn(3, 4, 10, dtype=torch.float64)
    targets = torch.randint(0, 9, (3, 4))
    barrier = threading.Barrier(2)
    slots: list[list[torch.Tensor]] = [[], []]

    def exchange(rank: int, value: torch.Tensor) -> list[torch.Tensor]:
        slots[rank].append(value.detach())
        barrier.wait()
        both = [slots[0][-1], slots[1][-1]]
        barrier.wait()
        return both

    def run(rank: int, out: dict[int, tuple[torch.Tensor, ...]]) -> None:
        shard = full[..., rank * 5 : (rank + 1) * 5].clone().requires_grad_(True)

        def reduce_sum(x: torch.Tensor) -> torch.Tensor:
            total = sum(exchange(rank, x), torch.zeros_like(x))
            return x + (total - x).detach()

        def reduce_max(x: torch.Tensor) -> torch.Tensor:
            a, b = exchange(rank, x)
            return torch.maximum(a, b)

        lp, ent = token_logprobs(shard, targets, rank * 5, 9, True, reduce_sum, reduce_max)
        assert ent is not None
        (lp.sum() + ent.sum()).backward()
        assert shard.grad is not None
        out[rank] = (lp.detach(), ent.detach(), shard.grad)

    results: dict[int, tuple[torch.Tensor, ...]] = {}
    threads = [threading.Thread(target=run, args=(r, results)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ref_logits = full.clone().requires_grad_(True)
    ref_lp, ref_ent = token_logprobs(ref_logits, targets, 0, 9, True)
    assert ref_ent is not None
    (ref_lp.sum() + ref_ent.sum()).backward()
    assert ref_logits.grad is not None
    for rank in (0, 1):
        lp, ent, grad = results[rank]
        torch.testing.assert_close(lp, ref_lp.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(ent, ref_ent.detach(), rtol=0, atol=1e-6)
        columns = ref_logits.grad[..., rank * 5 : (rank + 1) * 5].float()
        torch.testing.assert_close(grad.float(), columns, rtol=0, atol=1e-6)


def test_storage_offload_keeps_objects_views_and_values() -> None:
    flat = torch.arange(12.0)
    params = [flat[:4].view(2, 2), flat[4:]]  # views into one buffer, as Megatron's DDP has
    alias = flat[2:6]
    other = torch.ones(3)
    before = [t.clone() for t in (flat, other)]
    ids = [id(t) for t in (*params, alias, other)]
    offload = StorageOffload([*params, alias, other, flat], torch.device("cpu"))
    assert len(offload.holders) == 2 and offload.nbytes == 12 * 4 + 3 * 4
    offload.offload()
    assert flat.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    offload.onload()
    assert [id(t) for t in (*params, alias, other)] == ids
    torch.testing.assert_close(flat, before[0])
    torch.testing.assert_close(other, before[1])
    params[1][0] = -1.0  # still views of one storage
    assert flat[4] == -1.0 and alias[2] == -1.0


def test_storage_offload_discards_gradient_buffers_and_reuses_host_memory() -> None:
    params, grads = torch.arange(6.0), torch.zeros(6)
    main_grad = grads[2:]  # a view, as a parameter's main_grad
    first = StorageOffload([params, main_grad], torch.device("cpu"), discard=[grads])
    assert first.nbytes == 24 and first.discarded_sizes == [24]
    first.offload()
    assert grads.untyped_storage().nbytes() == 0
    first.onload()
    assert grads.untyped_storage().nbytes() == 24 and main_grad.shape == (4,)
    torch.testing.assert_close(params, torch.arange(6.0))
    again = StorageOffload([params], torch.device("cpu"), previous=first)
    assert again.host[0] is first.host[0]


def test_storage_offload_of_a_grown_set_reuses_the_host_copies_it_can() -> None:
    """Storages added since the last offload (adapters injected, optimizer state created) get
    host memory of their own; the others keep theirs, whatever their order now."""
    a, b = torch.arange(8.0), torch.arange(4.0) + 100
    first = StorageOffload([a, b], torch.device("cpu"))
    first.offload()
    first.onload()
    c = torch.full((6,), 7.0)
    again = StorageOffload([c, b, a], torch.device("cpu"), previous=first)
    assert again.host[2] is first.host[0] and again.host[1] is first.host[1]
    assert again.host[0] is None  # allocated at the offload
    again.offload()
    assert again.host[0] is not None and again.host[0].nbytes == 24
    assert again.host[2] is first.host[0]
    again.onload()
    assert torch.equal(a, torch.arange(8.0)) and torch.equal(b, torch.arange(4.0) + 100)
    assert torch.equal(c, torch.full((6,), 7.0))


def test_copy_runs_join_storages_one_block_apart_on_both_sides() -> None:
    """Storage i + 1 joins i's copy only where both sides put it exactly i's 512-byte block
    after i: a gap any larger (another block between), a different order or a host layout
    that differs starts a new copy."""
    sizes = [1000, 512, 3, 2048, 100]
    host = [0, 1024, 1536, 2048, 4096]  # each size rounded up to 512, back to back
    whole = [(0, 20_000)]  # one allocation holds them all
    assert copy_runs([10_240 + h for h in host], host, sizes, whole) == [range(0, 5)]
    device = [0, 1024, 1536 + 512, 2048 + 512, 4096 + 512]  # a block between 1 and 2
    assert copy_runs(device, host, sizes, whole) == [range(0, 2), range(2, 5)]
    device = [4096, 1024, 1536, 2048, 0]  # the last one first: its run stands alone
    assert copy_runs(device, host, sizes, whole) == [range(0, 1), range(1, 4), range(4, 5)]
    assert copy_runs([0, 1000], [0, 1024], [1000, 8], whole) == [range(0, 1), range(1, 2)]
    assert copy_runs([], [], [], whole) == []


def test_copy_runs_never_span_two_allocations() -> None:
    """Back to back on both sides is not enough: storages join only inside one known
    allocation (CUDA refuses a copy across two, even where their addresses meet), and where
    none is known each storage is a copy of its own."""
    sizes = [1024, 1024, 1024, 1024]
    host = [0, 1024, 2048, 3072]
    device = [8192 + h for h in host]
    assert copy_runs(device, host, sizes) == [range(i, i + 1) for i in range(4)]
    meeting = [(8192, 8192 + 2048), (8192 + 2048, 8192 + 4096)]  # two segments end to end
    assert copy_runs(device, host, sizes, meeting) == [range(0, 2), range(2, 4)]
    short = [(8192, 8192 + 2048 + 512)]  # storage 2 sticks out of the only known segment
    assert copy_runs(device, host, sizes, short) == [range(0, 2), range(2, 3), range(3, 4)]


def test_storage_offload_orders_large_storages_first_and_copies_each_on_a_cpu() -> None:
    """On a CPU every storage is its own copy (malloc's neighbours are not the offload's), and
    the host layout spaces them by the allocator's blocks, the large ones first."""
    small, large = torch.ones(3), torch.arange(2**18, dtype=torch.float32) + 1  # 12 B, 1 MiB
    huge = torch.full((2**18 + 1,), 2.0)  # 1 MiB + 4 B: the allocator's large pool on a GPU
    offload = StorageOffload([small, large, huge], torch.device("cpu"))
    assert offload.sizes == [2**20 + 4, 12, 2**20]
    offload.offload()
    starts = [h.data_ptr() - offload.host[0].data_ptr() for h in offload.host]
    assert starts == [0, 2**20 + 512, 2**20 + 1024]
    assert offload.copies == {"offload": 3}
    offload.onload()
    assert offload.copies == {"offload": 3, "onload": 3}
    assert torch.equal(large, torch.arange(2**18, dtype=torch.float32) + 1)
    assert torch.equal(huge, torch.full((2**18 + 1,), 2.0)) and torch.equal(small, torch.ones(3))


def test_attribute_tensors_finds_flags_and_shard_lists() -> None:
    class Wrapper:
        def __init__(self) -> None:
            self.flag = torch.zeros(1)
            self.groups = [[torch.ones(2), torch.ones(3)], [torch.ones(4)]]
            self.deeper = [[[torch.ones(5)]]]  # past two levels: not searched
            self.name = "adam"

    found = attribute_tensors(Wrapper())
    assert sorted(t.numel() for t in found) == [1, 2, 3, 4]
    assert attribute_tensors(None) == []
