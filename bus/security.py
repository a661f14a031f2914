"""The cluster secret and everything derived from it: CURVE keypairs and the gossip MAC key.

Key scheme (docs/security.md): one 32-byte secret per cluster, in a file only its owner can
read. From it, HKDF-SHA256 with distinct labels derives
- the cluster *server* keypair: every ROUTER and PUB is a CURVE server with it;
- the cluster *client* keypair: every DEALER and SUB is a CURVE client with it, and knows the
  server public key; the ZAP handler of every server admits that one client public key only;
- the gossip MAC key (HMAC-SHA256 over every gossip message, `bus.gossip`).
Whoever lacks the secret cannot complete a CURVE handshake with any node (they know neither
the server's public key nor an admitted client key), so they can neither send nor read.
Whoever holds it is a member: rotation means a new secret on every node.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils import z85

log = logging.getLogger(__name__)

SECRET_BYTES = 32
FILE_PREFIX = "specbus-secret-v1:"
ENV_VAR = "SPECBUS_SECRET_FILE"
ZAP_DOMAIN = "specbus"
_LABEL_SERVER = b"specbus curve server v1"
_LABEL_CLIENT = b"specbus curve client v1"
_LABEL_GOSSIP = b"specbus gossip mac v1"


class SecretError(ValueError):
    """The secret file is missing, unreadable, too open, malformed, or CURVE is unavailable."""


def check_curve() -> None:
    """Refuse to run secured when this libzmq was built without CURVE (libsodium)."""
    if not zmq.has("curve"):
        raise SecretError(
            f"this libzmq {zmq.zmq_version()} has no CURVE support (built without libsodium); "
            "install a pyzmq wheel with CURVE, or run without --secret-file on loopback")


def hkdf_sha256(key: bytes, label: bytes, length: int = 32) -> bytes:
    """RFC 5869 HKDF (extract with a fixed salt, expand with `label`)."""
    prk = hmac.new(b"specbus hkdf salt", key, hashlib.sha256).digest()
    out, block, i = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + label + bytes([i]), hashlib.sha256).digest()
        out += block
        i += 1
    return out[:length]


def _keypair(secret: bytes, label: bytes) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys of a Curve25519 keypair derived from the cluster secret."""
    sk = z85.encode(hkdf_sha256(secret, label))
    return zmq.curve_public(sk), sk


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def format_secret(secret: bytes) -> str:
    return f"{FILE_PREFIX}{secret.hex()}\n"


def parse_secret(text: str, where: str = "secret") -> bytes:
    body = text.strip()
    if not body.startswith(FILE_PREFIX):
        raise SecretError(f"{where} is not a specbus secret (expected a line "
                          f"'{FILE_PREFIX}<64 hex digits>' as written by `specbus keygen`)")
    hexpart = body[len(FILE_PREFIX):]
    try:
        secret = bytes.fromhex(hexpart)
    except ValueError:
        raise SecretError(f"{where}: the secret is not hexadecimal") from None
    if len(secret) != SECRET_BYTES:
        raise SecretError(f"{where}: the secret has {len(secret)} bytes, expected {SECRET_BYTES}")
    return secret


def write_secret_file(path: str | os.PathLike) -> Path:
    """Write a fresh secret to a new file with mode 0600; never overwrites."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SecretError(f"{p} exists; refusing to overwrite a secret (remove it first)") \
            from None
    except OSError as exc:
        raise SecretError(f"cannot create {p}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # whatever the umask
        f.write(format_secret(new_secret()))
    return p


def read_secret_file(path: str | os.PathLike) -> bytes:
    """Read a secret file, refusing one that is missing, not a file, readable by group or
    others, unreadable or malformed (each with a message that says which)."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise SecretError(f"secret file {p} does not exist (create one with "
                          f"`specbus keygen --out {p}`)") from None
    except OSError as exc:
        raise SecretError(f"cannot read secret file {p}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SecretError(f"secret file {p} is not a regular file")
    if st.st_mode & 0o077:
        raise SecretError(f"secret file {p} is readable by group or others (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {p}`")
    try:
        text = p.read_text(encoding="ascii")
    except PermissionError:
        raise SecretError(f"secret file {p} is not readable by this user") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SecretError(f"cannot read secret file {p}: {exc}") from None
    return parse_secret(text, f"secret file {p}")


@dataclass(frozen=True)
class Security:
    """The keys of one cluster; build with `from_file` or `from_secret`."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)
    gossip_key: bytes = field(repr=False)

    @classmethod
    def from_secret(cls, secret: bytes) -> Security:
        if len(secret) != SECRET_BYTES:
            raise SecretError(f"a cluster secret has {SECRET_BYTES} bytes, got {len(secret)}")
        check_curve()
        spub, ssec = _keypair(secret, _LABEL_SERVER)
        cpub, csec = _keypair(secret, _LABEL_CLIENT)
        return cls(spub, ssec, cpub, csec, hkdf_sha256(secret, _LABEL_GOSSIP))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Security:
        return cls.from_secret(read_secret_file(path))

    @property
    def fingerprint(self) -> str:
        """A short public tag of the cluster keys (safe to log; reveals nothing usable)."""
        return hashlib.sha256(self.server_public).hexdigest()[:12]

    def apply_server(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)

    def apply_client(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)


def resolve_secret_path(flag: str | None) -> str | None:
    """`--secret-file` if given, else $SPECBUS_SECRET_FILE, else None."""
    return flag or os.environ.get(ENV_VAR) or None


class ClusterGate:
    """ZAP credentials provider: admits the cluster client key, counts every refusal."""

    def __init__(self, security: Security) -> None:
        self._admitted = security.client_public
        self._lock = threading.Lock()  # the authenticator thread writes, telemetry reads
        self._denied = 0
        self._admitted_count = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(key, self._admitted)
        with self._lock:
            if ok:
                self._admitted_count += 1
            else:
                self._denied += 1
        if not ok:
            log.info("refused a CURVE handshake from a key outside the cluster")
        return ok

    @property
    def denied(self) -> int:
        with self._lock:
            return self._denied

    @property
    def admitted(self) -> int:
        with self._lock:
            return self._admitted_count
