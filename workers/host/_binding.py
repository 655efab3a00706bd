"""Where gloo listens: on the node's cluster address, never on every interface.

Gloo's pair listeners are made each time a gloo process group is; ``GLOO_SOCKET_IFNAME``
names the interface they bind to. :func:`bind_gloo_to_node` points it at the
interface holding Ray's node IP (loopback when Ray runs loopback-only).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket

import psutil

from channels import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["GLOO_SOCKET_IFNAME", "bind_gloo_to_node", "gloo_interface_for"]

GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
"""The environment variable gloo reads, each time a gloo process group is created,
for the network interface(s) its listeners bind to."""


def gloo_interface_for(node_ip: str) -> str:
    """The name of the network interface that holds ``node_ip`` (``"lo"`` for 127.0.0.1).

    Args:
        node_ip: this node's cluster address, as Ray reports it
            (``ray.util.get_node_ip_address()``).

    Raises:
        ConfigError: ``node_ip`` is not an IP address, or no interface of this
            host holds it.
    """
    try:
        wanted = ipaddress.ip_address(node_ip.split("%", 1)[0])
    except ValueError:
        raise ConfigError(f"node_ip {node_ip!r} is not an IP address") from None
    seen = []
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            seen.append(f"{name}={addr.address}")
            if ipaddress.ip_address(addr.address.split("%", 1)[0]) == wanted:
                return name
    raise ConfigError(
        f"node_ip {node_ip!r} is not an address of this host (its addresses: {', '.join(seen)}); "
        "pass the address Ray reports for this node (ray.util.get_node_ip_address())"
    )


def bind_gloo_to_node(node_ip: str) -> str:
    """Make gloo process groups created from now on in this process listen on the
    interface that holds ``node_ip`` (loopback when it is 127.0.0.1). Call it before
    ``init_process_group``.

    What gloo does otherwise (torch 2.13): each gloo process group opens TCP
    listeners, one per device, that its peers connect to during the group's
    full-mesh rendezvous. Without ``GLOO_SOCKET_IFNAME`` the device is
    ``ProcessGroupGloo.create_default_device()``: gloo resolves the machine's
    hostname and binds to the first resolved address it can bind, falling back
    to 127.0.0.1 when none works. So it binds one address, not the wildcard, but
    which one depends on ``/etc/hosts`` and DNS, not on the cluster: it may be a
    public interface, or 127.0.0.1/127.0.1.1 (common ``/etc/hosts`` entries),
    which breaks multi-node groups.

    This function sets ``GLOO_SOCKET_IFNAME`` to the interface holding Ray's node
    address. Gloo reads the variable each time it creates a process group
    (``init_process_group``, ``new_group``, ``DeviceMesh``), and binds each
    listener to that interface's first IPv4 or IPv6 address. An explicit device
    (``ProcessGroupGloo.create_device(hostname=node_ip)``) would pin the exact
    address, but ``init_process_group`` and ``new_group`` ignore ``pg_options``
    for gloo in torch 2.13, so the environment variable is the only setting that
    reaches every group. When ``node_ip`` is not the interface's first address,
    gloo binds that first address of the same interface; a warning says so.

    Args:
        node_ip: this node's cluster address (``ray.util.get_node_ip_address()``).

    Returns:
        The interface name it set.

    Raises:
        ConfigError: no interface of this host holds ``node_ip``.
    """
    name = gloo_interface_for(node_ip)
    first = next((a.address for a in psutil.net_if_addrs()[name]
                  if a.family in (socket.AF_INET, socket.AF_INET6)), None)
    if first is not None and ipaddress.ip_address(first.split("%", 1)[0]) != ipaddress.ip_address(
            node_ip.split("%", 1)[0]):
        logger.warning("gloo will listen on %s, the first address of interface %s, not on the "
                       "node address %s", first, name, node_ip)
    previous = os.environ.get(GLOO_SOCKET_IFNAME)
    if previous not in (None, name):
        logger.warning("replacing %s=%s by %s (the interface of node address %s)",
                       GLOO_SOCKET_IFNAME, previous, name, node_ip)
    os.environ[GLOO_SOCKET_IFNAME] = name
    return name
