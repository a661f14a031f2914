"""Test "hosts" in network namespaces: a bridge namespace and N host namespaces on 10.77.0.0/24.

Everything lives inside namespaces this module creates (veth pairs are created inside them,
nothing appears in the root namespace), and `Lan.close()` deletes them all, so traffic never
touches a real interface. Needs root and iproute2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be created here (not root, no iproute2, or the kernel refuses)."""


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=10)


class Lan:
    """`hosts` namespaces with addresses 10.77.0.1.. on one bridge; a context manager."""

    def __init__(self, hosts: int = 2, prefix: str = "specbus") -> None:
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2 `ip` is not installed")
        tag = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.bridge = f"{tag}-br"
        self.hosts = [f"{tag}-{i}" for i in range(1, hosts + 1)]
        self._created: list[str] = []
        try:
            for ns in (self.bridge, *self.hosts):
                _ip("netns", "add", ns)
                self._created.append(ns)
                _ip("link", "set", "lo", "up", ns=ns)
            _ip("link", "add", "br0", "type", "bridge", ns=self.bridge)
            _ip("link", "set", "br0", "up", ns=self.bridge)
            for i, ns in enumerate(self.hosts, 1):
                _ip("link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0", "netns", ns,
                    ns=self.bridge)
                _ip("link", "set", f"h{i}", "master", "br0", "up", ns=self.bridge)
                _ip("addr", "add", f"{self.address(i)}/24", "dev", "eth0", ns=ns)
                _ip("link", "set", "eth0", "up", ns=ns)
        except subprocess.CalledProcessError as exc:
            self.close()
            raise NetnsUnavailable(f"cannot build namespaces: {exc.stderr.strip()}") from exc

    @staticmethod
    def address(i: int) -> str:
        return f"10.77.0.{i}"

    def prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program inside host i (1-based)."""
        return ["ip", "netns", "exec", self.hosts[i - 1]]

    def close(self) -> None:
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self._created.clear()

    def __enter__(self) -> Lan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
