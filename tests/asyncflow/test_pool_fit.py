"""Whether a cluster's nodes can hold the pools: refused at once, naming what the
pools ask for and what the nodes have (asyncflow.runtime._pool.check_fits)."""

from __future__ import annotations

import pytest

from asyncflow import CPU_SLOT, ResourcePool
from asyncflow.runtime._pool import Node, check_fits, live_nodes, slot_resource
from channels import ConfigError


def _node(name: str, cpus: float, **labels: str) -> Node:
    return Node(id=name * 8, ip="10.0.0.1", resources={"CPU": cpus}, labels=labels)


def test_a_cpu_rank_takes_a_slot_where_the_cluster_offers_them_else_a_cpu() -> None:
    assert slot_resource("cpu", {CPU_SLOT: 64.0, "CPU": 2.0}) == CPU_SLOT
    assert slot_resource("cpu", {"CPU": 2.0}) == "CPU"
    assert slot_resource("cuda", {CPU_SLOT: 64.0, "GPU": 8.0}) == "GPU"


def test_pools_that_fit_pass() -> None:
    nodes = [_node("a", 2, role="trainer"), _node("b", 1, role="side")]
    check_fits([ResourcePool(name="main", devices=2, labels={"role": "trainer"}),
                ResourcePool(name="side", devices=1)], "cpu", "CPU", nodes)


def test_more_devices_than_the_cluster_has_names_both() -> None:
    nodes = [_node("a", 2), _node("b", 1)]
    with pytest.raises(ConfigError) as e:
        check_fits([ResourcePool(name="main", devices=2), ResourcePool(name="side", devices=2)], "cpu", "CPU", nodes)
    assert str(e.value) == ("the pools ask for 4 CPU in all (main: 2, side: 2) but the Ray cluster has 3 "
                            "(node aaaaaaaa (10.0.0.1): 2, node bbbbbbbb (10.0.0.1): 1)")


def test_a_pool_larger_than_the_nodes_it_may_use_is_refused() -> None:
    nodes = [_node("a", 4), _node("b", 1, role="side")]
    with pytest.raises(ConfigError, match=r"pool 'side' asks for 2 CPU \(2 devices\) but the nodes with its "
                                          r"labels have 1 \(node bbbbbbbb \(10.0.0.1\): 1\)"):
        check_fits([ResourcePool(name="side", devices=2, labels={"role": "side"})], "cpu", "CPU", nodes)


def test_labels_no_node_has_are_refused_with_the_labels_there_are() -> None:
    nodes = [_node("a", 4, role="trainer")]
    with pytest.raises(ConfigError, match=r"pool 'side' asks for nodes labelled role=side but no live node has "
                                          r"them \(labels in the cluster: role=trainer;"):
        check_fits([ResourcePool(name="side", devices=1, labels={"role": "side"})], "cpu", "CPU", nodes)


def test_only_live_nodes_count_and_rays_own_labels_are_left_out() -> None:
    answer = [{"NodeID": "a" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 2.0},
               "Labels": {"ray.io/node-id": "a" * 56, "role": "trainer"}},
              {"NodeID": "b" * 56, "Alive": False, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0},
               "Labels": {}}]
    assert live_nodes(answer) == [Node(id="a" * 56, ip="10.0.0.1", resources={"CPU": 2.0},
                                       labels={"role": "trainer"})]
