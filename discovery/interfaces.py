"""Which network a node uses: `--interface IP|NAME|all`, resolved to concrete addresses.

The default is loopback. LAN use is always an explicit choice; `all` is the only way to run
mDNS on every interface, and even then ZeroMQ binds one concrete address (never 0.0.0.0).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

import psutil

DEFAULT_INTERFACE = "127.0.0.1"


@dataclass(frozen=True)
class NetChoice:
    """`bind_host`: where ZeroMQ binds and what peers connect to; `mdns`: zeroconf interfaces
    (a list of IPv4 addresses, or None for every interface)."""

    spec: str
    bind_host: str
    mdns: tuple[str, ...] | None


def _ipv4_by_interface() -> dict[str, list[str]]:
    return {
        name: [a.address for a in addrs if a.family == socket.AF_INET]
        for name, addrs in psutil.net_if_addrs().items()
    }


def resolve_interface(spec: str) -> NetChoice:
    """Resolve the `--interface` value; raises ValueError with a specific message."""
    spec = (spec or "").strip()
    if not spec:
        raise ValueError("--interface must be an IPv4 address, an interface name or 'all'")
    by_if = _ipv4_by_interface()
    if spec == "all":
        candidates = [a for addrs in by_if.values() for a in addrs
                      if not ipaddress.ip_address(a).is_loopback]
        if not candidates:
            raise ValueError("--interface all: no non-loopback IPv4 address on this machine")
        return NetChoice(spec, sorted(candidates)[0], None)
    try:
        ip = ipaddress.ip_address(spec)
    except ValueError:
        if spec not in by_if:
            known = ", ".join(sorted(by_if)) or "none"
            raise ValueError(f"--interface {spec!r}: no such interface (known: {known})") from None
        if not by_if[spec]:
            raise ValueError(f"--interface {spec!r} has no IPv4 address") from None
        addr = by_if[spec][0]
        return NetChoice(spec, addr, (addr,))
    if ip.version != 4:
        raise ValueError(f"--interface {spec!r}: only IPv4 is supported for now")
    if ip.is_unspecified or ip.is_multicast:
        raise ValueError(f"--interface {spec!r}: give a concrete unicast address, or 'all'")
    local = {a for addrs in by_if.values() for a in addrs}
    if spec not in local and not ip.is_loopback:
        raise ValueError(f"--interface {spec}: this address is not on any interface here")
    return NetChoice(spec, spec, (spec,))
