"""``bind_to``: an actor's gloo, NCCL and vLLM are pointed at its node's address, by the
interface that holds it; variables a user set win."""

from __future__ import annotations

import os

import psutil
import pytest

from tandem.cluster.ray_cluster import bind_to, interface_of

VARIABLES = ("VLLM_HOST_IP", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """None of the variables set; what a test sets is undone after it."""
    for name in VARIABLES:
        monkeypatch.setenv(name, "")  # records the value to restore (or that there was none)
        monkeypatch.delenv(name)


def test_interface_of_finds_the_interface_holding_an_address() -> None:
    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            if entry.family.name in ("AF_INET", "AF_INET6"):
                assert interface_of(entry.address.split("%")[0]) == name
    assert interface_of("127.0.0.1") is not None
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: on no interface here


def test_bind_to_points_gloo_nccl_and_vllm_at_the_address(clean_env: None) -> None:
    bind_to("127.0.0.1")
    assert os.environ["VLLM_HOST_IP"] == "127.0.0.1"
    assert os.environ["GLOO_SOCKET_IFNAME"] == interface_of("127.0.0.1")
    assert os.environ["NCCL_SOCKET_IFNAME"] == interface_of("127.0.0.1")


def test_bind_to_keeps_what_the_user_set(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    bind_to("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    assert os.environ["NCCL_SOCKET_IFNAME"] == interface_of("127.0.0.1")


def test_bind_to_an_address_on_no_interface_sets_no_interface(clean_env: None) -> None:
    bind_to("203.0.113.77")
    assert os.environ["VLLM_HOST_IP"] == "203.0.113.77"
    assert "GLOO_SOCKET_IFNAME" not in os.environ and "NCCL_SOCKET_IFNAME" not in os.environ


def test_the_single_node_switch_is_off_only_while_a_local_cluster_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ray._private import ray_constants, services

    from tandem.cluster.ray_cluster import _single_node_switch

    name = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    monkeypatch.setenv(name, "1")
    before = ray_constants.ENABLE_RAY_CLUSTER
    with _single_node_switch():
        assert os.environ[name] == "0"  # for the processes the cluster starts
        assert services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"  # ray.init's call
    assert os.environ[name] == "1"
    assert before is ray_constants.ENABLE_RAY_CLUSTER
