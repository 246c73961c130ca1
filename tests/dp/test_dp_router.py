"""The native Router as Python sees it (the routing rules themselves have Rust tests)."""

from __future__ import annotations

from collections import Counter

import pytest

from corewire._native import Router


def test_burst_before_any_update_is_even_and_rotates() -> None:
    router = Router(4)
    assert router.num_engines == 4
    picks = [router.choose() for _ in range(64)]
    assert Counter(picks) == {0: 16, 1: 16, 2: 16, 3: 16}
    assert picks[:8] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert router.in_flight() == [16] * 4


def test_coordinator_counts_steer_and_in_flight_floors() -> None:
    router = Router(3)
    # Lists, as they come out of msgpack, and tuples both work.
    router.update_counts([[0, 9], (0, 0), [4, 0]])
    assert router.counts() == [(0, 9), (0, 0), (4, 0)]
    picks = Counter(router.choose() for _ in range(8))
    assert picks == {1: 6, 2: 2}
    assert router.loads() == [9, 6, 6]
    for _ in range(6):
        router.note_finished(1)
    assert router.in_flight() == [0, 0, 2]


def test_explicit_rank_wins_and_is_checked() -> None:
    router = Router(2)
    router.update_counts([[100, 100], [0, 0]])
    assert router.route(0) == 0
    assert router.route(None) == 1
    with pytest.raises(ValueError, match="data_parallel_rank 2 is out of range"):
        router.route(2)
    with pytest.raises(ValueError):
        router.route(-1)
    with pytest.raises(ValueError):
        router.note_sent(9)
    router.note_sent(1, 3)
    assert router.in_flight() == [1, 4]


@pytest.mark.parametrize(
    "counts",
    [[[-1, 0]], [[1]], [[1, 2, 3]], ["ab"], [None], [[1.5, 2]], [[2**40, 0]]],
)
def test_bad_counts_raise_and_change_nothing(counts: list) -> None:
    router = Router(2)
    router.update_counts([[1, 2], [3, 4]])
    with pytest.raises((TypeError, ValueError, OverflowError)):
        router.update_counts(counts)
    assert router.counts() == [(1, 2), (3, 4)]


def test_resize_and_errors() -> None:
    with pytest.raises(ValueError, match="at least one engine"):
        Router(0)
    router = Router(2)
    for _ in range(4):
        router.choose()
    router.resize(3)
    assert router.in_flight() == [2, 2, 0]
    assert router.choose() == 2
    router.resize(1)
    assert router.in_flight() == [2]
    router.note_finished(2)  # a removed engine: ignored
    with pytest.raises(ValueError):
        router.resize(0)
    assert "Router(num_engines=1" in repr(router)


def test_several_front_ends_start_apart_and_scale_their_own_counts() -> None:
    """vLLM's API servers each route over all engines (its client_index, client_count):
    their first picks differ, and each counts its own requests as every front-end's."""
    servers = [Router(4, i, 2) for i in range(2)]
    assert [r.client_count for r in servers] == [2, 2]
    assert [r.choose() for r in servers] == [0, 2]
    # A burst at each server before any report: still even over the engines.
    picks = Counter(r.choose() for _ in range(15) for r in servers)
    picks.update([0, 2])
    assert picks == {0: 8, 1: 8, 2: 8, 3: 8}
    alone = Router(2)
    alone.update_counts([[0, 3], [0, 0]])
    pair = Router(2, 0, 2)
    pair.update_counts([[0, 3], [0, 0]])
    for router in (alone, pair):
        router.note_sent(1, 2)
    assert (alone.loads(), pair.loads()) == ([3, 2], [3, 4])
    with pytest.raises(ValueError, match="client_index 2 is out of range"):
        Router(2, 2, 2)
    with pytest.raises(ValueError, match="out of range"):
        Router(2, 0, 0)
