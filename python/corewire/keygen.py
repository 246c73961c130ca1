"""``corewire keygen``: ZeroMQ CURVE keys for engines on other hosts, and the helpers that use them.

A front-end that listens on a non-loopback TCP address (``data_parallel_address=
"tcp://10.0.0.1:5555"``) accepts only peers that prove they hold an authorized key, so no
one who can reach the port can inject requests or read outputs. The listening side (the
front-end and its DP coordinator) is the CURVE *server*; every engine (or remote
front-end) that connects is a CURVE *client* with its own key pair, and the server keeps
the public keys it accepts in a directory.

``corewire keygen DIR --clients 2`` writes a ready-to-copy layout::

    DIR/server/server.key_secret          the listening side's key pair (mode 0600)
    DIR/server/server.key                 its public key
    DIR/server/authorized_clients/*.key   public keys of the clients it accepts
    DIR/client-0/client.key_secret        client 0's key pair (mode 0600)
    DIR/client-0/server.key               the server's public key, to verify it
    DIR/client-1/...

Copy ``DIR/server`` to the front-end host and ``DIR/client-K`` to each engine host; then
``curve_keys="DIR/server"`` on the front-end and ``--curve-keys DIR/client-K`` on
``corewire engine``. Key files use ZeroMQ's certificate format (readable by
``zmq.auth.load_certificate``).

Authentication runs in pyzmq's own ZAP authenticator (``zmq.auth.thread.
ThreadAuthenticator``, wrapped by :class:`CurveAuthenticator`: one thread per ZeroMQ
context) that accepts a CURVE client only if its public key is in the authorized set; a
client with any other key, or one that does not know the server's public key, fails the
handshake and never reaches the application.

Wire format: docs/protocol.md §10 (security rules).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
import zmq.auth.thread

logger = logging.getLogger("corewire.keygen")
__all__ = [
    "CurveAuthenticator",
    "CurveClientKeys",
    "CurveServerKeys",
    "add_arguments",
    "apply_client",
    "apply_server",
    "run",
    "write_key_layout",
    "write_keypair",
]

_SERVER_NAME = "server"
_CLIENT_NAME = "client"
_AUTHORIZED_DIR = "authorized_clients"
#: The ZAP domain corewire sockets use; the authenticator only accepts keys for it.
ZAP_DOMAIN = "corewire"


def _write_key_file(path: Path, public: bytes, secret: bytes | None) -> None:
    """Writes one key file in ZeroMQ's certificate (ZPL) format; secrets get mode 0600."""
    lines = [
        f"#   corewire CURVE {'secret' if secret else 'public'} key, "
        f"written {datetime.datetime.now().isoformat(timespec='seconds')}",
        "#   " + ("Never share this file." if secret else "Give this file to peers."),
        "",
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    # O_EXCL + explicit mode: a secret is never readable by others, even for an instant.
    mode = 0o600 if secret is not None else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def write_keypair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Writes ``name.key`` (public) and ``name.key_secret`` (0600) into ``directory``.

    Returns the two paths. Refuses to overwrite an existing key (``FileExistsError``).
    """
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    public_path = directory / f"{name}.key"
    secret_path = directory / f"{name}.key_secret"
    _write_key_file(secret_path, public, secret)
    _write_key_file(public_path, public, None)
    return public_path, secret_path


def _load_public(path: Path) -> bytes:
    public, _ = zmq.auth.load_certificate(path)
    return public


def _load_pair(path: Path) -> tuple[bytes, bytes]:
    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise ValueError(f"{path} holds no secret key")
    return public, secret


@dataclass(frozen=True)
class CurveServerKeys:
    """The listening side's key pair and the client public keys it accepts."""

    public: bytes
    secret: bytes
    authorized: frozenset[bytes]

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> CurveServerKeys:
        """Loads ``server.key_secret`` and ``authorized_clients/*.key`` from ``directory``."""
        directory = Path(directory)
        public, secret = _load_pair(directory / f"{_SERVER_NAME}.key_secret")
        auth_dir = directory / _AUTHORIZED_DIR
        if not auth_dir.is_dir():
            raise ValueError(f"no authorized client keys: {auth_dir} is not a directory")
        # pyzmq's loader of a key directory (every *.key file), as zmq.auth reads it.
        authorized = frozenset(zmq.auth.load_certificates(auth_dir))
        if not authorized:
            raise ValueError(f"no authorized client keys (*.key) in {auth_dir}")
        return cls(public=public, secret=secret, authorized=authorized)


@dataclass(frozen=True)
class CurveClientKeys:
    """A connecting peer's key pair and the server public key it expects."""

    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> CurveClientKeys:
        """Loads ``client.key_secret`` and ``server.key`` from ``directory``."""
        directory = Path(directory)
        public, secret = _load_pair(directory / f"{_CLIENT_NAME}.key_secret")
        server_public = _load_public(directory / f"{_SERVER_NAME}.key")
        return cls(public=public, secret=secret, server_public=server_public)

    def to_wire(self) -> list[str]:
        """The keys as z85 text, to hand to a child process on its command line."""
        return [self.public.decode(), self.secret.decode(), self.server_public.decode()]

    @classmethod
    def from_wire(cls, keys: list[str]) -> CurveClientKeys:
        """Inverse of :meth:`to_wire`."""
        public, secret, server_public = (k.encode() for k in keys)
        return cls(public=public, secret=secret, server_public=server_public)


def apply_server(sock: zmq.Socket[Any], keys: CurveServerKeys) -> None:
    """Makes ``sock`` a CURVE server; call before ``bind``. Needs a
    :class:`CurveAuthenticator` running on the socket's context, or every client is
    refused."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.curve_server = True


def apply_client(sock: zmq.Socket[Any], keys: CurveClientKeys) -> None:
    """Makes ``sock`` a CURVE client of the server ``keys.server_public``; call before
    ``connect``."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


class _AuthorizedKeys:
    """The authenticator's credentials provider (pyzmq's ``configure_curve_callback``
    protocol): accepts the authorized keys and logs each refused key once.

    pyzmq's directory mode (``configure_curve``) would accept the same keys but report a
    refusal only at DEBUG level; an intruder knocking should be visible in the log.
    """

    def __init__(self, authorized: frozenset[bytes]) -> None:
        self.authorized = authorized
        #: Refused handshakes so far, per z85 public key.
        self.refused: dict[bytes, int] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        """Whether the CURVE client with z85 public ``key`` may connect (auth thread)."""
        if key in self.authorized:
            return True
        # A refused peer retries every ~100 ms: log each key once, count the rest.
        seen = self.refused.get(key, 0)
        self.refused[key] = seen + 1
        if not seen:
            logger.warning(
                "refused a CURVE peer with key %s: not an authorized client key",
                key.decode(errors="replace"),
            )
        return False


def _stop_authenticator(auth: zmq.auth.thread.ThreadAuthenticator) -> None:
    # A context already gone took the thread's sockets with it: nothing left to stop.
    with contextlib.suppress(zmq.ZMQError):
        auth.stop()


class CurveAuthenticator:
    """pyzmq's ZAP authenticator on ``ctx``: CURVE clients whose public key is in
    ``authorized`` get in, every other peer is refused.

    Owns one thread, named ``corewire-zap``; :meth:`stop` (or collection of this object)
    ends it. Start it before binding any CURVE server socket on ``ctx``, stop it before
    terminating ``ctx``.
    """

    def __init__(self, ctx: zmq.Context[Any], authorized: frozenset[bytes]) -> None:
        self._keys = _AuthorizedKeys(authorized)
        auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logger)
        auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self._keys)
        auth.start()
        #: The authenticator's thread (renamed ``corewire-zap``, to tell it in a dump).
        self.thread = auth.thread
        self.thread.name = "corewire-zap"
        # pyzmq's own __del__ never runs while its thread refers to it: stop it from
        # here when this wrapper goes, holding the authenticator but not the wrapper.
        self._finalizer = weakref.finalize(self, _stop_authenticator, auth)

    @property
    def refused(self) -> dict[bytes, int]:
        """Refused handshakes so far, per z85 public key."""
        return self._keys.refused

    def stop(self) -> None:
        """Stops the thread (idempotent); call before terminating the context."""
        self._finalizer()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``corewire keygen``."""
    parser.add_argument("directory", help="where to write the keys (created if missing)")
    parser.add_argument(
        "--clients",
        type=int,
        default=1,
        help="number of client key pairs (one per engine host or remote front-end)",
    )


def run(args: argparse.Namespace) -> int:
    """Writes a server key pair and ``--clients`` client key pairs (see the module doc)."""
    if args.clients < 0:
        print("corewire keygen: --clients must be >= 0")
        return 2
    root = Path(args.directory)
    if (root / "server").exists():
        print(f"corewire keygen: {root / 'server'} exists; refusing to overwrite keys")
        return 1
    write_key_layout(root, args.clients)
    print(f"wrote {root}/server (front-end host) and {args.clients} client dir(s) {root}/client-K")
    return 0


def write_key_layout(root: str | os.PathLike[str], clients: int) -> None:
    """Writes the layout of the module docstring under ``root``: ``server/`` with its
    authorized client keys, and ``client-0`` .. ``client-{clients-1}`` (each 0700).
    Refuses to overwrite an existing key (``FileExistsError``)."""
    root = Path(root)
    server_dir = root / "server"
    server_public, _ = write_keypair(server_dir, _SERVER_NAME)
    server_dir.chmod(0o700)
    authorized = server_dir / _AUTHORIZED_DIR
    authorized.mkdir()
    for k in range(clients):
        client_dir = root / f"client-{k}"
        client_public, _ = write_keypair(client_dir, _CLIENT_NAME)
        client_dir.chmod(0o700)
        _write_key_file(client_dir / f"{_SERVER_NAME}.key", _load_public(server_public), None)
        _write_key_file(authorized / f"client-{k}.key", _load_public(client_public), None)
