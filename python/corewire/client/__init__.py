"""Clients that drive engine cores in child processes over ZeroMQ.

- :class:`AsyncMPClient`: asyncio client (output task, utility futures).
- :class:`SyncMPClient`: blocking client (output thread, ``queue.Queue``).
- :class:`MPClient`: their base (sockets, engine processes, ready handshake, death).
"""

from __future__ import annotations

from corewire.client.async_client import AsyncMPClient
from corewire.client.core import MPClient
from corewire.client.dp import DPAsyncMPClient, DPLBAsyncMPClient
from corewire.client.sync_client import SyncMPClient

__all__ = ["AsyncMPClient", "DPAsyncMPClient", "DPLBAsyncMPClient", "MPClient", "SyncMPClient"]
