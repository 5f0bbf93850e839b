"""A trainer whose state cannot fit its GPU is refused with the settings that would fit it; the
bytes are counted from the model as it will train (tied weights once, frozen weights without
gradients or AdamW state, FSDP2's shards)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.cluster.groups import LocalGroup, WorkerError
from tandem.config import PolicyConfig
from tandem.config.load import ConfigError
from tandem.trainer.fits import (
    check_state_fits,
    megatron_fit_problem,
    megatron_state_bytes,
    state_bytes,
    state_fit_problem,
)

H100 = 85_017_493_504  # bytes, as torch reports an H100 80GB HBM3
H200 = 150_754_820_096
QWEN25_7B = 7_615_616_512  # parameters


def test_counts_trained_weights_four_times_and_tied_ones_once() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied: one parameter
    frozen = nn.Linear(4, 3).requires_grad_(False)  # 15 fp32 parameters, no optimizer state
    params = [*model.parameters(), *frozen.parameters()]
    need, count, trained = state_bytes(params, world_size=1)
    assert (count, trained) == (55, 40)
    assert need == 40 * 4 * 4 + 15 * 4
    assert state_bytes(params, world_size=4)[0] == -(-need // 4)  # each rank's shard
    half = [p.detach().to(torch.bfloat16).requires_grad_() for p in model.parameters()]
    assert state_bytes(half, world_size=1)[0] == 40 * 2 * 4


def fits(config: PolicyConfig, params: int, world: int, have: int) -> str | None:
    bytes_each = 2 if config.dtype == "bfloat16" else 4
    need = -(-params * bytes_each * 4 // world)
    return state_fit_problem(config, need, params, params, world, have, "NVIDIA H100 80GB HBM3")


def test_7b_in_fp32_is_refused_on_80_gb_with_the_settings_that_fit_it() -> None:
    problem = fits(PolicyConfig(), QWEN25_7B, 1, H100)
    assert problem is not None
    assert "7.62 B parameters in float32" in problem and "121.8 GB" in problem
    assert "85.0 GB" in problem
    for setting in (
        "cluster.num_trainers=2",
        "policy.cpu_offload=true",
        "policy.lora",
        "policy.optimizer.bf16_stochastic_round=true",
    ):
        assert setting in problem
    # and each way it names does fit: bf16 state, two trainers
    assert fits(PolicyConfig(dtype="bfloat16", mixed_precision=False), QWEN25_7B, 1, H100) is None
    assert fits(PolicyConfig(), QWEN25_7B, 2, H100) is None
    assert fits(PolicyConfig(), QWEN25_7B, 1, H200) is None  # 141 GB: the state fits


def test_bf16_state_that_still_does_not_fit_offers_no_bf16() -> None:
    config = PolicyConfig(dtype="bfloat16", mixed_precision=False)
    problem = fits(config, 14_770_000_000, 1, H100)  # 14B in bf16: 118 GB
    assert problem is not None and "bf16_stochastic_round" not in problem
    assert "cluster.num_trainers=2" in problem


class StartsTrainer:
    """A worker whose start is the trainer's check on a GPU of ``have`` bytes."""

    def __init__(self, have: int):
        self.have = have

    def start(self) -> None:
        problem = fits(PolicyConfig(), QWEN25_7B, 1, self.have)
        if problem is not None:
            raise ConfigError(problem)


def test_worker_failure_says_it_in_one_message() -> None:
    group = LocalGroup([StartsTrainer(H100)], "trainer")
    with pytest.raises(WorkerError) as err:
        group.run("start")
    message = str(err.value)
    assert message.startswith("trainer worker rank 0 failed in start(): policy: the trainer's")
    assert "ConfigError" not in message and "Traceback" not in message
    assert err.value.from_setting  # the CLI's exit status 2: a user's mistake
    assert LocalGroup([StartsTrainer(H200)], "trainer").run("start") == [None]


def test_nothing_to_check_off_cuda() -> None:
    model = nn.Linear(1000, 1000)
    check_state_fits(model, PolicyConfig(), 1, torch.device("cpu"))  # no GPU: no bound
    need, _, _ = state_bytes(model.parameters(), 1)
    assert need == (1000 * 1000 + 1000) * 16


def test_an_offload_larger_than_the_host_is_refused_naming_what_fits_it() -> None:
    """7B with fp32 weights on the 141 GB card: 122 GB of state to page-lock on a host with
    ~120 GB available."""
    from tandem.trainer.fits import host_fit_problem

    need = QWEN25_7B * 16
    problem = host_fit_problem(need, 120_000_000_000, 1)
    assert problem is not None
    assert "121.8 GB of page-locked host memory" in problem and "120.0 GB available" in problem
    assert "cluster.memory_phases=false" in problem and "bf16_stochastic_round" in problem
    assert "policy.offload_weights=false" in problem
    assert host_fit_problem(QWEN25_7B * 8, 120_000_000_000, 1) is None  # the AdamW state alone
    assert host_fit_problem(QWEN25_7B * 6, 120_000_000_000, 1) is None  # bf16 state: 46 GB
    # two trainer ranks of one host each pin their share
    two = host_fit_problem(QWEN25_7B * 8, 120_000_000_000, 2)
    assert two is not None and "each of this host's 2 trainer ranks" in two


def test_the_megatron_trainers_offload_names_what_fits_it() -> None:
    """The Megatron-core trainer offloads all of its state (no offload of the optimizer alone,
    no bf16 rounding there): its refusal names what changes its share instead."""
    from tandem.trainer.fits import host_fit_problem

    need = QWEN25_7B * 18  # bf16 weights, fp32 gradients, main weights and Adam's moments
    problem = host_fit_problem(need, 120_000_000_000, 1, megatron=True)
    assert problem is not None and "137.1 GB of page-locked host memory" in problem
    assert "cluster.memory_phases=false" in problem
    assert "policy.megatron.tensor_parallel_size" in problem
    assert "policy.backend=fsdp2" in problem and "bf16_stochastic_round" not in problem
    assert host_fit_problem(need // 2, 120_000_000_000, 1, megatron=True) is None  # TP over 2


def test_the_offload_check_reads_this_hosts_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    from tandem.trainer.fits import available_host_bytes, check_offload_fits

    available = available_host_bytes()  # what the kernel reports, as psutil reads it too
    assert abs(available - psutil.virtual_memory().available) < 0.05 * available
    check_offload_fits(1 << 20)  # a MiB fits any host
    with pytest.raises(ConfigError, match=r"cluster\.memory_phases=false"):
        check_offload_fits(4 * available)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="each of this host's 8 trainer ranks"):
        check_offload_fits(available // 4)  # a quarter each, eight of them


def test_megatron_counts_its_gradient_buffer_and_sharded_optimizer_state() -> None:
    """The Megatron-core trainer's bytes a rank: bf16 weights 2, DDP's fp32 gradients 4, the
    distributed optimizer's fp32 main weights and Adam's moments 12 over the data-parallel
    ranks; fp32 weights are their own main weights (4 + 4 + 8); a frozen copy only weights."""
    assert megatron_state_bytes(1000, bf16=True, trainable=True, data_parallel=1) == 18_000
    assert megatron_state_bytes(1000, bf16=True, trainable=True, data_parallel=4) == 9_000
    assert megatron_state_bytes(1000, bf16=False, trainable=True, data_parallel=1) == 16_000
    assert megatron_state_bytes(1000, bf16=True, trainable=False, data_parallel=8) == 2_000


def test_megatron_7b_on_one_80_gb_gpu_is_refused_naming_the_layouts_that_fit() -> None:
    config = PolicyConfig(backend="megatron")
    need = megatron_state_bytes(QWEN25_7B, bf16=True, trainable=True, data_parallel=1)
    problem = megatron_fit_problem(config, need, QWEN25_7B, 1, H100, "NVIDIA H100 80GB HBM3")
    assert problem is not None and "137.1 GB" in problem and "85.0 GB" in problem
    for setting in (
        "policy.megatron.tensor_parallel_size",
        "cluster.num_trainers=2",
        "policy.backend=fsdp2",
        "policy.optimizer.bf16_stochastic_round=true",
    ):
        assert setting in problem
    # tensor parallel over two H100s: each rank holds half the model and fits
    half = megatron_state_bytes(QWEN25_7B // 2, bf16=True, trainable=True, data_parallel=1)
    assert megatron_fit_problem(config, half, QWEN25_7B // 2, 2, H100, "H100") is None
    # on the 141 GB card it fits as it is; a frozen reference copy fits anywhere here
    assert megatron_fit_problem(config, need, QWEN25_7B, 1, H200, "H200") is None
    frozen = megatron_state_bytes(QWEN25_7B, bf16=True, trainable=False, data_parallel=1)
    assert megatron_fit_problem(config, frozen, QWEN25_7B, 1, H100, "H100") is None


def test_a_reward_model_counts_what_trains_at_its_widest_and_names_what_fits() -> None:
    """``tandem rm``: frozen lower layers count once, unless ``model.unfreeze_after`` trains
    them later; a 7B reward model trained whole in fp32 is refused on an 80 GB card naming the
    top layers alone, bf16 and a smaller model."""
    from tandem.trainer.fits import reward_model_fit_problem, reward_model_state

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))  # 20 + 5 parameters
    model[0].requires_grad_(False)
    assert reward_model_state(model, unfreezes=False)[1:] == (25, 5)
    assert reward_model_state(model, unfreezes=False)[0] == 20 * 4 + 5 * 16
    assert reward_model_state(model, unfreezes=True) == (25 * 16, 25, 25)
    assert not model[0].weight.requires_grad  # counting changed nothing
    need = QWEN25_7B * 16
    problem = reward_model_fit_problem(need, QWEN25_7B, QWEN25_7B, "float32", H100, "H100", False)
    assert problem is not None and "121.8 GB" in problem
    for setting in ("model.trainable_layers", "model.dtype=bfloat16", "model.model_path"):
        assert setting in problem
    later = reward_model_fit_problem(need, QWEN25_7B, QWEN25_7B, "bfloat16", H100, "H100", True)
    assert later is not None and "model.unfreeze_after: null" in later
    assert "model.dtype=bfloat16" not in later
    top = QWEN25_7B // 8  # the top layers alone
    fits_top = reward_model_fit_problem(
        QWEN25_7B * 4 + top * 12, QWEN25_7B, top, "float32", H100, "H100", False
    )
    assert fits_top is None


def test_each_check_reads_its_device_and_refuses_what_does_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The three device checks (FSDP2, Megatron, reward model) against a device that reports
    256 bytes (``torch.cuda.get_device_properties``, the one thing read of it): a 10-parameter
    fp32 model of 8 parameters trained whole takes 128 bytes and fits (Megatron: 128), one of
    110 does not."""
    from types import SimpleNamespace

    from tandem.trainer.fits import check_megatron_state_fits, check_reward_model_fits

    tiny = SimpleNamespace(total_memory=256, name="a 256-byte GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: tiny)
    cuda = torch.device("cuda", 0)
    small, large = nn.Linear(3, 2, bias=True), nn.Linear(10, 10)  # 8 and 110 parameters
    check_state_fits(small, PolicyConfig(), 1, cuda)
    check_reward_model_fits(small, "float32", False, cuda)
    check_megatron_state_fits(small, PolicyConfig(backend="megatron"), False, True, 1, cuda)
    with pytest.raises(ConfigError, match="a 256-byte GPU"):
        check_state_fits(large, PolicyConfig(), 1, cuda)
    with pytest.raises(ConfigError, match="reward model's training state"):
        check_reward_model_fits(large, "float32", False, cuda)
    with pytest.raises(ConfigError, match="Megatron trainer's state"):
        check_megatron_state_fits(large, PolicyConfig(backend="megatron"), False, True, 1, cuda)
