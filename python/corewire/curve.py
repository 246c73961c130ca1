"""Where CURVE is required: the policy every socket that binds or connects applies.

An endpoint reachable from other hosts (a non-loopback ``tcp://`` address) must run behind
CURVE keys (:mod:`corewire.keygen` writes and loads them): an open port would let anyone
who reaches it inject requests or read outputs. ``ipc://``, ``inproc://`` and loopback
TCP stay plain.

Wire format: docs/protocol.md §10 (security rules).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

__all__ = ["is_loopback_address", "require_curve_for"]


def is_loopback_address(address: str) -> bool:
    """Whether a ZeroMQ endpoint is reachable only from this host (ipc, inproc, loopback)."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = urlsplit(f"//{rest}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname, '*' or an interface name: may be reachable from outside
        return False


def require_curve_for(address: str, keys: object | None) -> None:
    """Raises ``ValueError`` when ``address`` can be reached from other hosts but no CURVE
    keys are given: an open port would let anyone inject requests."""
    if keys is None and not is_loopback_address(address):
        raise ValueError(
            f"binding {address} exposes engines to other hosts: pass CURVE keys "
            "(write them with `corewire keygen DIR`), or bind a loopback address"
        )
