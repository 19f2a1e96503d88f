"""The n-gram lookup proposer."""

import pytest

from mlx_redrafter.lookup import Lookup


def test_no_match():
    assert Lookup([1, 2, 3, 4, 5]).propose(4) == []


def test_history_shorter_than_n_min():
    lk = Lookup([7], n_max=3, n_min=2)
    assert lk.propose(4) == []
    lk.extend([7])  # "7 7": the suffix (7, 7) has never been seen before
    assert lk.propose(4) == []
    assert Lookup([], n_max=3, n_min=1).propose(4) == []


def test_match_at_the_very_end():
    # The suffix (2, 3) was seen once, at the start; its continuation is 9 then the suffix itself.
    lk = Lookup([2, 3, 9, 5, 2, 3])
    assert lk.propose(3) == [[9, 5, 2]]
    # The continuation reaches the end of the history: it repeats (9 5 2 3 9 ...).
    assert lk.propose(6) == [[9, 5, 2, 3, 9, 5]]


def test_longest_suffix_and_latest_occurrence_win():
    # (1, 2) was followed by 8, then by 4; the 3-gram (0, 1, 2) was followed by 8.
    lk = Lookup([0, 1, 2, 8, 6, 1, 2, 4, 6, 0, 1, 2])
    assert lk.propose(1) == [[8]]
    lk = Lookup([0, 1, 2, 8, 6, 1, 2, 4, 6, 5, 1, 2])
    assert lk.propose(1) == [[4]]  # no 3-gram match: the latest (1, 2) wins


def test_overlapping_repeats():
    lk = Lookup([5, 5, 5, 5])
    assert lk.propose(4) == [[5, 5, 5, 5]]
    lk = Lookup([9, 1, 2, 1, 2, 1])
    assert lk.propose(5) == [[2, 1, 2, 1, 2]]


def test_l_larger_than_the_continuation():
    # (4,) occurred once, right before the last token: its continuation is just [4], repeated.
    lk = Lookup([3, 4, 4])
    assert lk.propose(5) == [[4, 4, 4, 4, 4]]
    lk = Lookup([1, 2, 3, 1])
    assert lk.propose(7) == [[2, 3, 1, 2, 3, 1, 2]]


def test_incremental_equals_built_at_once():
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 2, 3, 1]
    lk = Lookup(n_max=3, n_min=1)
    for i, t in enumerate(seq):
        lk.extend([t])
        assert lk.propose(3, 2) == Lookup(seq[: i + 1]).propose(3, 2)


def test_several_drafts_are_distinct_and_longest_first():
    lk = Lookup([7, 1, 2, 3, 9, 2, 3, 8, 5, 1, 2, 3])
    # (1, 2, 3) -> 9; (2, 3) latest -> 8; (3,) latest -> 8 (a duplicate, skipped).
    assert lk.propose(2, 3) == [[9, 2], [8, 5]]
    assert lk.propose(2, 1) == [[9, 2]]


def test_bad_orders_are_refused():
    with pytest.raises(ValueError):
        Lookup(n_max=1, n_min=2)
