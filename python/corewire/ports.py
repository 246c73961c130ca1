"""TCP ports chosen before something else binds them (a child process, vLLM, an engine
on another node). Racy by nature: another process can take a port in between, so each
caller either retries on "address already in use" or lets its user name the port.
"""

from __future__ import annotations

import random
import socket

__all__ = ["unused_port", "unused_port_block"]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def unused_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` a moment ago (the OS's pick for port 0)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def unused_port_block(host: str = "127.0.0.1", count: int = 4) -> int:
    """A base port such that ``base .. base+count-1`` on ``host`` were all free a moment
    ago (the consecutive ports of a ``data_parallel_address``)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000)
        held = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(_family(host), socket.SOCK_STREAM)
                held.append(sock)
                sock.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise OSError(f"found no {count} consecutive free ports on {host}")
