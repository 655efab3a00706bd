"""The session rendezvous over Ray (``workers.host._rendezvous``) on real Ray and gloo.

Three Ray actors form a gloo process group through a :class:`RayStore`, then make
sub-groups and device meshes and run collectives over them. The store's semantics
are checked against a real ``TCPStore``, operation by operation, and the group's
listening sockets are checked from outside: gloo listens only on the node's
address, and no listener of the group's processes serves a ``TCPStore`` client.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psutil
import pytest
import ray
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from channels import ConfigError
from support import probe_with_tcpstore_clients, tcp_listeners
from workers.host._binding import GLOO_SOCKET_IFNAME, bind_gloo_to_node, gloo_interface_for
from workers.host._rendezvous import RayStore, RendezvousError, RendezvousTimeoutError
from workers.host._store_server import StoreServer

# The rank actors below live in this file, which Ray workers cannot import.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

WORLD = 3
Listener = tuple[str, int]


@ray.remote(num_cpus=0)
class Rank:
    """One member of the test's process group."""

    def pid(self) -> int:
        return os.getpid()

    def join(self, server: Any, rank: int) -> str:
        """Bind gloo to the node's address and join the group; return that address."""
        node_ip = ray.util.get_node_ip_address()
        bind_gloo_to_node(node_ip)
        dist.init_process_group("gloo", store=RayStore(server, timedelta(seconds=30)),
                                rank=rank, world_size=WORLD)
        return node_ip

    def collectives(self) -> dict[str, Any]:
        """The same sequence of group calls on every rank (rank 2 skips the pair group,
        which only its members create with local synchronization)."""
        from torch.distributed.device_mesh import init_device_mesh

        rank = dist.get_rank()
        out: dict[str, Any] = {}
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        out["world_sum"] = x.item()
        if rank < 2:
            pair = dist.new_group([0, 1], use_local_synchronization=True)
            y = torch.tensor([float(10 * (rank + 1))])
            dist.all_reduce(y, group=pair)
            out["pair_sum"] = y.item()
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        z = torch.tensor([1.0])
        dist.all_reduce(z, group=mesh.get_group("dp"))
        out["mesh_sum"] = z.item()
        # A 2-D mesh makes sub-groups (one per rank along "tp"), each a rendezvous.
        grid = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "tp"))
        w = torch.tensor([float(rank)])
        dist.all_reduce(w, group=grid.get_group("tp"))
        dist.all_reduce(w, group=grid.get_group("dp"))
        out["grid_sum"] = w.item()
        dist.barrier()
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, {"rank": rank, "pid": os.getpid()})
        out["gathered"] = gathered
        return out

    def all_reduce(self) -> float:
        x = torch.ones(1)
        dist.all_reduce(x)
        return x.item()

    def leave(self) -> None:
        dist.destroy_process_group()



@pytest.fixture(scope="module")
def server(shared_ray: None) -> Any:
    return ray.remote(StoreServer).options(num_cpus=0).remote()


@pytest.fixture(scope="module")
def group(shared_ray: None) -> Iterator[dict[str, Any]]:
    """Three ranks in a gloo group, with their listeners from before they joined it."""
    ranks = [Rank.remote() for _ in range(WORLD)]
    pids = ray.get([r.pid.remote() for r in ranks])
    before = {pid: tcp_listeners(pid) for pid in pids}
    server = ray.remote(StoreServer).options(num_cpus=0).remote()
    node_ips = ray.get([r.join.remote(server, i) for i, r in enumerate(ranks)], timeout=60)
    assert len(set(node_ips)) == 1
    yield {"ranks": ranks, "pids": pids, "before": before, "node_ip": node_ips[0]}
    ray.get([r.leave.remote() for r in ranks])
    for r in [*ranks, server]:
        ray.kill(r)


# ----- the group -----


def test_collectives_over_ray_rendezvous(group: dict[str, Any]) -> None:
    outs = ray.get([r.collectives.remote() for r in group["ranks"]], timeout=60)
    assert [o["world_sum"] for o in outs] == [6.0] * WORLD
    assert [o.get("pair_sum") for o in outs] == [30.0, 30.0, None]
    assert [o["mesh_sum"] for o in outs] == [3.0] * WORLD
    # "tp" groups have one rank each, so "dp" sums the ranks: 0 + 1 + 2.
    assert [o["grid_sum"] for o in outs] == [3.0] * WORLD
    expected = [{"rank": i, "pid": pid} for i, pid in enumerate(group["pids"])]
    assert all(o["gathered"] == expected for o in outs)


def test_listeners_bind_node_address_and_reject_store_clients(group: dict[str, Any],
                                                              tcp_store: dist.TCPStore) -> None:
    """What the group's processes listen on, once gloo is up.

    Each actor process listened on one socket before it joined the group: the
    gRPC server of Ray's core worker, which other Ray processes call to submit
    actor tasks. Ray binds it to all interfaces (``::``), or to 127.0.0.1 when Ray
    runs loopback-only as in these tests (conftest), and Ray 2.60 authenticates
    its callers (token auth, on by default for local clusters). Every listener
    that joining the group added is gloo's: it must be bound to the node's
    address. No listener may serve a TCPStore client, the protocol the old
    rendezvous exposed; a real TCPStore is probed alongside to show the probe
    would notice one.
    """
    ray.get([r.collectives.remote() for r in group["ranks"]], timeout=60)  # all groups made
    node_ip = group["node_ip"]
    wildcard = {"0.0.0.0", "::"}
    probes: list[Listener] = []
    for pid in group["pids"]:
        now = tcp_listeners(pid)
        ray_own = group["before"][pid]
        gloo = now - ray_own
        assert gloo, f"pid {pid}: no gloo listener found among {sorted(now)}"
        assert {ip for ip, _ in gloo} == {node_ip}, f"pid {pid}: gloo listens on {sorted(gloo)}"
        assert {ip for ip, _ in now if ip in wildcard} <= {ip for ip, _ in ray_own}
        probes += sorted(now)
    control = ("127.0.0.1", tcp_store.port)
    served = probe_with_tcpstore_clients([*probes, control], node_ip)
    tcp_store.delete_key("probe")  # the semantics tests compare key counts
    assert served == [f"SERVED {control[0]} {control[1]}"], f"served a TCPStore client: {served}"
    # The probes did not disturb the group.
    assert ray.get([r.all_reduce.remote() for r in group["ranks"]], timeout=30) == [3.0] * WORLD





# ----- store semantics against TCPStore -----


STORE_TIMEOUT = timedelta(seconds=30)
"""Both stores' default timeout: a guard against a hang only (an actor call on a
busy 2-core machine took more than 5 s once), the timeouts tested are their own."""


@pytest.fixture(scope="module")
def tcp_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)


@pytest.fixture(scope="module")
def ray_store(server: Any) -> RayStore:
    return RayStore(server, STORE_TIMEOUT)


TEXT_KEYS = ["a", "b", "c"]
COUNTERS = ["n0", "n1"]  # only add() writes these: TCPStore drops a client that adds to text
VALUES = st.sampled_from([b"", b"x", b"yy", b"\x00\xff"])
Op = tuple[Any, ...]

OPS = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(TEXT_KEYS), VALUES),
    st.tuples(st.just("get"), st.sampled_from(TEXT_KEYS + COUNTERS)),
    st.tuples(st.just("add"), st.sampled_from(COUNTERS), st.integers(-5, 5)),
    st.tuples(st.just("compare_set"), st.sampled_from(TEXT_KEYS), VALUES, VALUES),
    st.tuples(st.just("append"), st.sampled_from(TEXT_KEYS), VALUES),
    st.tuples(st.just("check"), st.lists(st.sampled_from(TEXT_KEYS + COUNTERS), max_size=3)),
    st.tuples(st.just("delete_key"), st.sampled_from(TEXT_KEYS + COUNTERS)),
    st.tuples(st.just("num_keys")),
    st.tuples(st.just("multi_set"), st.lists(st.tuples(st.sampled_from(TEXT_KEYS), VALUES),
                                             max_size=3)),
    st.tuples(st.just("multi_get"), st.lists(st.sampled_from(TEXT_KEYS + COUNTERS), max_size=3)),
)


def _apply(store: dist.Store, op: Op) -> Any:
    """Run ``op``; a read of missing keys reports them missing instead of waiting."""
    name, *args = op
    if name in ("get", "multi_get"):
        keys = [args[0]] if name == "get" else args[0]
        if not store.check(keys):
            return "missing"
    if name == "multi_set":
        keys, values = [k for k, _ in args[0]], [v for _, v in args[0]]
        return store.multi_set(keys, values)
    return getattr(store, name)(*args)


def _prefixed(store: dist.Store) -> dist.Store:
    # What torch hands the backends: every call crosses the C++ trampoline.
    return dist.PrefixStore("t", store)


def _direct(store: dist.Store) -> dist.Store:
    return store


@pytest.mark.parametrize("wrap", [_direct, _prefixed], ids=["direct", "prefix_store"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, max_size=15))
def test_same_results_as_tcpstore(tcp_store: dist.TCPStore, ray_store: RayStore,
                                  wrap: Callable[[dist.Store], dist.Store], ops: list[Op]) -> None:
    ours, theirs = wrap(ray_store), wrap(tcp_store)
    try:
        for i, op in enumerate(ops):
            assert _apply(ours, op) == _apply(theirs, op), f"op {i}: {op} after {ops[:i]}"
    finally:  # the next example starts from empty stores, even after a failure
        deleted = {k: (ours.delete_key(k), theirs.delete_key(k)) for k in TEXT_KEYS + COUNTERS}
    assert all(a == b for a, b in deleted.values()), deleted
    assert ours.num_keys() == theirs.num_keys()


@pytest.mark.parametrize("wrap", [_direct, _prefixed], ids=["direct", "prefix_store"])
def test_timeouts_name_keys_and_timeout(tcp_store: dist.TCPStore, ray_store: RayStore, server: Any,
                                        wrap: Callable[[dist.Store], dist.Store]) -> None:
    ours, theirs = wrap(ray_store), wrap(tcp_store)
    ours.set("present", b"1")
    theirs.set("present", b"1")
    # Keys that are never set: a TCPStore client keeps a timed-out wait registered.
    with pytest.raises(dist.DistStoreError):
        theirs.wait(["never-w", "present"], timedelta(seconds=0.2))
    with pytest.raises(RendezvousTimeoutError, match=r"\['(t/)?never-w'\].*0\.2 s"):
        ours.wait(["never-w", "present"], timedelta(seconds=0.2))
    short = wrap(RayStore(server, timedelta(seconds=0.3)))
    with pytest.raises(RendezvousTimeoutError, match=r"get: keys \['(t/)?never-g'\].*0\.3 s"):
        short.get("never-g")
    with pytest.raises(RendezvousTimeoutError, match=r"multi_get: keys \['(t/)?never-m'\]"):
        short.multi_get(["present", "never-m"])


def test_timeout_is_a_runtime_error_for_torch(server: Any) -> None:
    # _store_based_barrier catches RuntimeError from wait() to log and wait again.
    store = dist.PrefixStore("barrier/", RayStore(server, timedelta(seconds=0.2)))
    with pytest.raises(RuntimeError):
        store.wait(["never"], timedelta(seconds=0.1))


def test_waiters_wake_on_set_and_deleted_keys_wait_again(server: Any) -> None:
    waiting = server.wait.remote(["late", "later"], 20.0)
    ray.get(server.set.remote("late", b"1"))
    ready, _ = ray.wait([waiting], timeout=0.3)
    assert not ready  # "later" is still missing
    start = time.monotonic()
    ray.get(server.add.remote("later", 1))
    ray.get(waiting, timeout=10)
    assert time.monotonic() - start < 5
    assert ray.get(server.delete_key.remote("late"))
    again = server.get.remote("late", 20.0)
    ready, _ = ray.wait([again], timeout=0.3)
    assert not ready
    ray.get(server.append.remote("late", b"2"))
    assert ray.get(again, timeout=10) == b"2"
    for key in ("late", "later"):
        ray.get(server.delete_key.remote(key))


def test_reset_forgets_every_key_but_not_while_a_rank_waits(shared_ray: None) -> None:
    """What a session hands the next one (asyncflow.runtime._idle): an empty store;
    a store somebody still waits in is not reset (it is not handed on)."""
    server = ray.remote(StoreServer).options(num_cpus=0).remote()
    ray.get([server.set.remote("a", b"1"), server.add.remote("n", 2)])
    waiting = server.get.remote("b", 20.0)
    ray.wait([waiting], timeout=0.3)
    assert ray.get(server.reset.remote()) is False
    assert ray.get(server.num_keys.remote()) == 2, "nothing forgotten while a rank waits"
    ray.get(server.set.remote("b", b"2"))
    assert ray.get(waiting, timeout=10) == b"2"
    assert ray.get(server.reset.remote()) is True
    assert ray.get(server.num_keys.remote()) == 0
    again = server.get.remote("b", 20.0)  # a key set before the reset is waited for again
    assert not ray.wait([again], timeout=0.3)[0]
    ray.get(server.set.remote("b", b"3"))
    assert ray.get(again, timeout=10) == b"3"
    ray.kill(server)


def test_add_to_text_value_fails_naming_key(ray_store: RayStore) -> None:
    ray_store.set("text", b"abc")
    with pytest.raises(dist.DistStoreError, match=r"add\('text'\).*not a counter"):
        ray_store.add("text", 1)
    ray_store.delete_key("text")


def test_dead_store_actor_is_a_store_error(shared_ray: None) -> None:
    doomed = ray.remote(StoreServer).options(num_cpus=0).remote()
    store = RayStore(doomed, timedelta(seconds=10))
    store.set("k", b"v")
    waiting = doomed.get.remote("never-set", 60.0)  # blocks on the actor until it dies
    ray.kill(doomed)  # only sends the kill: a call made at once could still be served
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(waiting, timeout=60)
    with pytest.raises(RendezvousError, match="rendezvous store actor is gone"):
        store.get("k")


def test_pickles_and_clones_to_the_same_store(ray_store: RayStore) -> None:
    copy = pickle.loads(pickle.dumps(ray_store))
    assert isinstance(copy, RayStore) and copy.timeout == ray_store.timeout
    copy.set("shared", b"v")
    assert ray_store.clone().get("shared") == b"v"
    assert ray_store.delete_key("shared")


# ----- binding -----


def test_gloo_interface_for_loopback_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    loopback = gloo_interface_for("127.0.0.1")
    assert any(a.address == "127.0.0.1" for a in psutil.net_if_addrs()[loopback])
    with pytest.raises(ConfigError, match="not an address of this host"):
        gloo_interface_for("203.0.113.77")
    with pytest.raises(ConfigError, match="not an IP address"):
        gloo_interface_for("node-1")
    monkeypatch.delenv(GLOO_SOCKET_IFNAME, raising=False)
    assert bind_gloo_to_node("127.0.0.1") == loopback
    assert os.environ[GLOO_SOCKET_IFNAME] == loopback


def _first_addresses() -> dict[str, str]:
    """Each interface's first IPv4 address: the one gloo binds for ``GLOO_SOCKET_IFNAME``."""
    out = {}
    for name, addrs in psutil.net_if_addrs().items():
        first = next((a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)), None)
        if first is not None and ":" not in first:
            out[name] = first
    return out


def test_gloo_listens_where_bind_gloo_to_node_says(monkeypatch: pytest.MonkeyPatch) -> None:
    # Loopback, plus one other interface when there is one: gloo's default here
    # (hostname resolution) may well be loopback, so only the other shows the choice.
    loopback = gloo_interface_for("127.0.0.1")
    others = [ip for name, ip in sorted(_first_addresses().items()) if name != loopback]
    for ip in ["127.0.0.1", *others[:1]]:
        monkeypatch.delenv(GLOO_SOCKET_IFNAME, raising=False)
        bind_gloo_to_node(ip)
        before = tcp_listeners(os.getpid())
        pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
        opened = tcp_listeners(os.getpid()) - before
        del pg
        assert opened and {addr for addr, _ in opened} == {ip}, (ip, opened)
