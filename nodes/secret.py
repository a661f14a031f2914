"""Which security a node runs with: the cluster secret, plain on loopback, or `--insecure`.

Policy (docs/security.md): with a secret file, every socket is CURVE and gossip is MACed. On
loopback without one, nothing changes (one machine, one user's processes). On any other
interface a node refuses to start without a secret unless `--insecure` is given; it then
warns at start and its card says `insecure`, which the monitor and `specbus members` show.
"""

from __future__ import annotations

import ipaddress
import logging

from bus.security import SecretError, Security, resolve_secret_path

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def security_for(secret_file: str | None, insecure: bool, bind_host: str,
                 what: str = "node") -> Security | None:
    """The node's Security, or None for plain sockets; SecretError when refused."""
    path = resolve_secret_path(secret_file)
    if path:
        return Security.from_file(path)
    if is_loopback(bind_host):
        return None
    if not insecure:
        raise SecretError(
            f"refusing to run a {what} on {bind_host} without a cluster secret: anyone on "
            f"that network could join, read prompts and submit work. Create one with "
            f"`specbus keygen --out FILE`, copy it (mode 0600) to every machine and pass "
            f"--secret-file FILE (or set SPECBUS_SECRET_FILE), or pass --insecure to run "
            f"unprotected")
    log.warning("INSECURE: %s on %s without a cluster secret; anyone who can reach it can "
                "join, read traffic and submit work", what, bind_host)
    return None
