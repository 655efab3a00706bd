"""Two pools on two Ray nodes (``ray.cluster_utils.Cluster``) exchange rows with the
same code as on one machine."""

from __future__ import annotations

import asyncio

import pytest
import torch
from ray.cluster_utils import Cluster

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from support import Consumer, Producer, Sleeper, expected_x

pytestmark = pytest.mark.usefixtures("no_shared_ray")  # it joins a cluster


def test_pools_on_two_nodes_exchange_rows() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {af.CPU_SLOT: 4, "node_a": 4}, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={af.CPU_SLOT: 4, "node_b": 4})
    cluster.wait_for_nodes()
    try:
        async def main():
            async with af.Session(address=cluster.address) as session:
                on_a = ResourcePool(name="a", devices=2, resources={"node_a": 1})
                on_b = ResourcePool(name="b", devices=2, resources={"node_b": 1})
                roles = await session.spawn({
                    "producer": RoleSpec(cls=Producer, pool=on_a),
                    "consumer": RoleSpec(cls=Consumer, pool=on_b),
                    "where_a": RoleSpec(cls=Sleeper, pool=on_a),
                    "where_b": RoleSpec(cls=Sleeper, pool=on_b),
                })
                nodes = (set(await roles.where_a.node()), set(await roles.where_b.node()))
                src = await session.put({"idx": torch.arange(10)}, pool=on_a)
                out = await roles.consumer.echo(roles.producer.produce(src, width=8)).fetch()
                return nodes, out, session.transport

        (nodes_a, nodes_b), out, transport = asyncio.run(main())
    finally:
        af.shutdown_ray()
        cluster.shutdown()
    assert len(nodes_a) == len(nodes_b) == 1 and nodes_a != nodes_b
    assert transport == "gloo"
    assert torch.equal(out["idx"], torch.arange(10))
    assert torch.equal(out["x"].double(), expected_x(torch.arange(10), 8))
