"""Who may call the gateway from a browser: the `Host` a request names and the `Origin` of the
page that sent it.

- `Host` must be one of the addresses the gateway serves: the IP address it is bound to (any
  IP address when bound to all of them), `localhost` when that reaches it, this machine's own
  names when it serves the network, and names given with `--allow-host` (`*`: any). A web page
  that rebinds its own DNS name to 127.0.0.1 sends its name as `Host` and is refused: without
  this check such a page drives a loopback gateway as if it were local (DNS rebinding).
- `Origin` (sent by browsers only): on a loopback gateway, pages from `http://localhost:*`,
  `http://127.0.0.1:*` and `http://[::1]:*` (and https) are allowed by default, as
  llama-server does; any other origin needs `--cors-origin` (`*`: any). A request carrying an
  origin that is not allowed is refused before it runs (a cross-site `text/plain` POST cannot
  start a generation whose answer the page could not read anyway), with a message naming the
  flag.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def _ip(text: str):
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def host_name(header: str) -> str | None:
    """The host part of a `Host` header (`name`, `name:port`, `[v6]:port`), lowercased,
    without a trailing dot; None when it cannot be read."""
    try:
        name = urllib.parse.urlsplit("//" + header.strip()).hostname
    except ValueError:
        return None
    return name.rstrip(".").lower() if name else None


class Origins:
    def __init__(self, bind_host: str, cors_origins: tuple[str, ...] = (),
                 allow_hosts: tuple[str, ...] = ()) -> None:
        ip = _ip(bind_host)
        self.loopback = ip is not None and ip.is_loopback
        self.wildcard = ip is not None and ip.is_unspecified
        self.bind_ip = ip
        self.cors_origins = frozenset(o.rstrip("/") for o in cors_origins)
        self.any_origin = "*" in self.cors_origins
        self.any_host = "*" in allow_hosts
        names = {h.rstrip(".").lower() for h in allow_hosts if h != "*"}
        if self.loopback or self.wildcard:
            names.add("localhost")
        if not self.loopback:  # served to the network: this machine's own names too
            host = socket.gethostname().lower()
            names |= {host, f"{host}.local", host.split(".")[0]}
        self.host_names = frozenset(names)

    # -- Host ----------------------------------------------------------------------------------
    def host_allowed(self, header: str | None) -> bool:
        """True for a request without `Host` (HTTP/1.0 tools) and for one naming an address
        this gateway serves."""
        if header is None or self.any_host:
            return True
        name = host_name(header)
        if name is None:
            return False
        if name in self.host_names:
            return True
        ip = _ip(name)
        if ip is None:
            return False
        if self.wildcard:
            return True
        if self.loopback:
            return ip.is_loopback
        return ip == self.bind_ip

    # -- Origin --------------------------------------------------------------------------------
    def origin_allowed(self, origin: str) -> bool:
        if self.any_origin or origin.rstrip("/") in self.cors_origins:
            return True
        if not self.loopback:
            return False
        try:
            u = urllib.parse.urlsplit(origin)
            port = u.port  # ValueError when it is not a number
        except ValueError:
            return False
        del port
        return (u.scheme in ("http", "https") and u.hostname in LOCAL_NAMES
                and not u.path.strip("/") and not u.query)
