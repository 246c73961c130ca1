"""A DP coordinator's publications as the DP clients read them, in either vLLM version.

A publication is ``[counts, current_wave, engines_running]``, ``counts`` one entry per
engine in rank order (or nil when only the wave state changed). An entry is
``[waiting, running]`` from vLLM 0.25.1's coordinator and corewire's, and
``[waiting, running, kv_cache_usage]`` (a float in 0.0-1.0) from vLLM 0.33.0's: both are
read, whatever the client's protocol.

:func:`router_counts` turns them into the ``[waiting, running]`` pairs the router takes.
Under ``release="0.33.0"`` it applies vLLM 0.33.0's KV-pressure rule: an engine's
waiting requests count ``6 * max(0, kv_cache_usage - 0.5)`` times more (none at half
usage or less, three times more when the KV cache is full), because a queue on a
KV-bound engine drains slowly (docs/vllm-0.33.0-notes.md §6.2). The rest of vLLM
0.33.0's score (``max(client_count * own_in_flight, waiting + running)``) is not taken:
the router's own load (``max(waiting + running + sent_since_update, own_in_flight)``,
:class:`corewire._native.Router`) serves the same purpose for both versions and is not
seen on the wire.

Wire format: docs/protocol.md §8 and docs/vllm-0.33.0-notes.md §5.3.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from corewire.errors import ProtocolError

__all__ = ["Publication", "decode_publication", "kv_penalty", "router_counts"]

#: vLLM 0.33.0's weight of a waiting request per unit of KV cache usage above half.
KV_PRESSURE_WEIGHT = 6.0
#: The KV cache usage above which waiting requests weigh more (vLLM 0.33.0).
KV_PRESSURE_FROM = 0.5


class Publication(NamedTuple):
    """One coordinator publication, checked: ``counts`` entries are ``[waiting, running]``
    or ``[waiting, running, kv_cache_usage]`` (ints, then a float)."""

    counts: list[list[Any]] | None
    current_wave: int
    engines_running: bool


class _Wire(NamedTuple):
    counts: list[list[int | float]] | None
    current_wave: int
    engines_running: bool


_decoder = msgspec.msgpack.Decoder(_Wire)


def decode_publication(frame: Any) -> Publication:
    """Decodes and checks a publication; raises :class:`~corewire.errors.ProtocolError`
    for anything else."""
    try:
        wave = _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"DP coordinator publication: {exc}") from exc
    counts = wave.counts
    if counts is not None:
        for index, entry in enumerate(counts):
            if not (
                2 <= len(entry) <= 3
                and type(entry[0]) is int
                and type(entry[1]) is int
                and entry[0] >= 0
                and entry[1] >= 0
            ):
                raise ProtocolError(
                    f"DP coordinator publication: counts[{index}] must be [waiting, running] "
                    f"or [waiting, running, kv_cache_usage], got {entry!r:.80}"
                )
    return Publication(counts, wave.current_wave, wave.engines_running)


def kv_penalty(waiting: int, kv_cache_usage: float) -> int:
    """vLLM 0.33.0's extra load for ``waiting`` requests at ``kv_cache_usage``, rounded to
    the router's whole requests."""
    if not waiting or kv_cache_usage <= KV_PRESSURE_FROM:
        return 0
    return round(waiting * KV_PRESSURE_WEIGHT * (kv_cache_usage - KV_PRESSURE_FROM))


def router_counts(counts: list[list[Any]], kv_pressure: bool) -> list[list[int]]:
    """The router's ``[waiting, running]`` per engine; with ``kv_pressure`` the waiting
    count of an entry that carries ``kv_cache_usage`` includes :func:`kv_penalty`."""
    if not kv_pressure:
        return [entry if len(entry) == 2 else entry[:2] for entry in counts]
    pairs = []
    for entry in counts:
        waiting = entry[0]
        if len(entry) == 3:
            waiting += kv_penalty(waiting, entry[2])
        pairs.append([waiting, entry[1]])
    return pairs
