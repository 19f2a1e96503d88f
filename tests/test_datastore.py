"""The suffix datastore: its index against a brute-force reference, eviction,
its file (round trip, refusals) and the proposer."""

import logging
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_redrafter.draft.datastore import index as ds
from mlx_redrafter.draft.datastore.index import NO_MATCH, Datastore, StoreLookup, default_path, load_or_empty, propose
from mlx_redrafter.errors import RedrafterError
from mlx_redrafter.files import cache_root
from mlx_redrafter.step.tree import PAD

# A small vocabulary makes long matches and many occurrences likely.
tokens = st.lists(st.integers(0, 3), max_size=14)
histories = st.lists(st.integers(0, 3), max_size=20)


def brute_match(seqs, history, max_match, k, length, scan):
    """``(length, occurrences, continuations)`` by scanning every position."""

    def ends(m):  # (sequence, position) of each occurrence of history[-m:] with a token after it
        pat = list(history[-m:])
        return [(i, e) for i, s in enumerate(seqs) for e in range(m - 1, len(s) - 1) if s[e - m + 1 : e + 1] == pat]

    best = 0
    for m in range(1, min(max_match, len(history)) + 1):
        if not ends(m):
            break
        best = m
    if not best:
        return 0, 0, []
    found = ends(best)
    stats = {}
    for i, e in sorted(found)[-scan:]:  # the latest `scan` occurrences
        cont = tuple(seqs[i][e + 1 : e + 1 + length])
        count, latest = stats.get(cont, (0, (-1, -1)))
        stats[cont] = (count + 1, max(latest, (i, e)))
    ranked = sorted(stats.items(), key=lambda kv: kv[1], reverse=True)[:k]
    return best, len(found), [(c, n) for c, (n, _) in ranked]


def kept(seqs, max_tokens):
    """The eviction policy: oldest whole sequences first; a long one keeps its tail."""
    out = []
    for s in seqs:
        if s:
            out.append(s[-max_tokens:])
        while sum(map(len, out)) > max_tokens:
            out.pop(0)
    return out


def as_tuple(m):
    return m.length, m.occurrences, m.continuations


ops = st.lists(st.one_of(st.tuples(st.just("add"), tokens), st.tuples(st.just("match"), histories)), max_size=12)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 60), st.integers(1, 16), st.integers(1, 6), st.integers(1, 5), st.sampled_from([1, 3, 512]))
def test_index_matches_brute_force(ops, max_tokens, max_match, k, length, scan):
    """Adds and matches interleaved (the index is rebuilt lazily), with eviction."""
    store, added = Datastore(max_tokens=max_tokens, model_id="m"), []
    for op, arg in ops:
        if op == "add":
            store.add(arg)
            added.append(arg)
            continue
        seqs = kept(added, max_tokens)
        assert as_tuple(store.match(arg, max_match, k, length, scan)) == brute_match(
            seqs, arg, max_match, k, length, scan
        )
    assert store.sequences() == kept(added, max_tokens)
    assert store.tokens == sum(map(len, store.sequences())) <= max_tokens


def test_many_occurrences_are_counted_with_numpy():
    """Past ``FEW`` occurrences the vectorised counting runs; it agrees with the reference."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 3, int(rng.integers(1, 30))).tolist() for _ in range(80)]
    store = Datastore(model_id="m")
    for s in seqs:
        store.add(s)
    checked = 0
    for _ in range(60):
        h = rng.integers(0, 3, int(rng.integers(1, 4))).tolist()
        m = store.match(h, max_continuations=50, length=4, scan=10_000)
        checked += m.occurrences > ds.FEW
        assert as_tuple(m) == brute_match(seqs, h, 16, 50, 4, 10_000)
    assert checked > 10


def test_large_ranges_are_bisected(monkeypatch):
    """A tiny ``GATHER`` makes the descent bisect token by token, as in a large store."""
    monkeypatch.setattr(ds, "GATHER", 1)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 4, 40).tolist() for _ in range(30)]
    store = Datastore(model_id="m")
    for s in seqs:
        store.add(s)
    for _ in range(40):
        h = seqs[int(rng.integers(30))][: int(rng.integers(1, 40))] + rng.integers(0, 4, 2).tolist()
        assert as_tuple(store.match(h, length=3, max_continuations=3)) == brute_match(seqs, h, 16, 3, 3, ds.SCAN)


def test_continuations_stop_at_the_sequence_end():
    store = Datastore(model_id="m")
    store.add([1, 2, 3])
    store.add([9, 9, 9, 9])
    m = store.match([5, 1, 2], length=4)
    assert (m.length, m.continuations) == (2, [((3,), 1)])
    # The last token of a sequence has nothing after it: it is no occurrence.
    assert store.match([3]) == NO_MATCH


@pytest.mark.parametrize("few", [ds.FEW, 0], ids=["python", "numpy"])
def test_counts_rank_first_then_the_latest_occurrence(monkeypatch, few):
    monkeypatch.setattr(ds, "FEW", few)
    store = Datastore(model_id="m")
    for s in ([1, 2, 7], [1, 2, 8], [1, 2, 8], [1, 2, 7], [1, 2, 9], [1, 2, 9], [1, 2, 9]):
        store.add(s)
    m = store.match([1, 2], length=2, max_continuations=3)
    # 9 is the most frequent; 7 and 8 tie, and 7 occurred last (in the 4th sequence).
    assert m.continuations == [((9,), 3), ((7,), 2), ((8,), 2)]
    assert store.match([1, 2], length=2, max_continuations=3, scan=4).continuations == [((9,), 3), ((7,), 1)]


def test_empty_store():
    store = Datastore(model_id="m")
    store.add([])
    assert len(store) == 0 and store.tokens == 0
    assert store.match([1, 2, 3]) == NO_MATCH
    row, n, count = propose(store, [1, 2], 4)
    assert row.tolist() == [PAD] * 4 and (n, count) == (0, 0)
    with tempfile.TemporaryDirectory() as d:
        store.save(Path(d) / "s.bin")
        assert Datastore.open(Path(d) / "s.bin", "m").sequences() == []


def test_bad_arguments_are_refused():
    store = Datastore(model_id="m", depth=4)
    with pytest.raises(RedrafterError, match="max_match"):
        store.match([1], max_match=5)
    with pytest.raises(RedrafterError, match="Token ids"):
        store.add([1, -2])


# -- the file ------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(tokens, max_size=8), st.lists(histories, max_size=4), st.integers(1, 40))
def test_save_and_lazy_load_round_trip(seqs, queries, max_tokens):
    store = Datastore(max_tokens=max_tokens, model_id="org/model")
    for s in seqs:
        store.add(s)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "sub" / "history.bin"
        store.save(path)
        assert path.stat().st_size == 36 + len("org/model") + 4 * (len(store) + store.tokens)
        loaded = Datastore.open(path, "org/model", max_tokens=max_tokens)
        assert loaded.sequences() == store.sequences()
        for h in queries:
            assert as_tuple(loaded.match(h, length=3)) == as_tuple(store.match(h, length=3))
        assert not list(path.parent.glob(".partial-*"))


def test_open_reads_on_first_use(tmp_path):
    path = tmp_path / "s.bin"
    lazy = Datastore.open(path, "m")  # no file yet: opening reads nothing
    other = Datastore(model_id="m")
    other.add([4, 5, 6])
    other.save(path)
    assert lazy.match([4, 5]).continuations == [((6,), 1)]
    lazy.add([4, 5, 7])
    lazy.save()  # appends to what the file held
    assert Datastore.open(path, "m").sequences() == [[4, 5, 6], [4, 5, 7]]
    assert Datastore.open(tmp_path / "missing.bin", "m").sequences() == []


def saved(tmp_path, model_id="m"):
    store = Datastore(model_id=model_id)
    store.add([1, 2, 3, 4])
    return store.save(tmp_path / "s.bin")


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda p: p.write_bytes(b"not a datastore at all, just text"), "not a mlx-redrafter datastore"),
        (lambda p: p.write_bytes(p.read_bytes()[:-3]), "corrupt"),
        (lambda p: flip_byte(p, -6), "corrupt"),  # a token id: the checksum catches it
        (
            lambda p: p.write_bytes(p.read_bytes()[:8] + struct.pack("<I", 99) + p.read_bytes()[12:]),
            "format version 99",
        ),
    ],
    ids=["garbage", "truncated", "flipped", "version"],
)
def test_damaged_or_other_version_files_are_refused(tmp_path, damage, why):
    path = saved(tmp_path)
    damage(path)
    with pytest.raises(RedrafterError, match=why) as e:
        Datastore.open(path, "m").match([1, 2])
    assert str(path) in str(e.value) and "mlx-redrafter datastore clear" in str(e.value)


def test_a_file_of_another_model_is_refused(tmp_path):
    path = saved(tmp_path, model_id="org/llama")
    with pytest.raises(RedrafterError, match="org/llama") as e:
        Datastore.open(path, "org/qwen").sequences()
    assert str(path) in str(e.value) and "datastore clear" in str(e.value)


def test_generation_gets_an_empty_store_and_a_warning(tmp_path, caplog):
    path = saved(tmp_path, model_id="org/llama")
    before = path.read_bytes()
    with caplog.at_level(logging.WARNING):
        store = load_or_empty(path, "org/qwen")
        assert store.match([1, 2]) == NO_MATCH and len(store) == 0
    assert "org/llama" in caplog.text and str(path) in caplog.text
    store.add([7, 8])
    with pytest.raises(RedrafterError, match="Not saving over"):
        store.save()  # the refused file is kept as it was
    assert path.read_bytes() == before
    store.clear()
    store.add([7, 8])
    store.save()
    assert Datastore.open(path, "org/qwen").sequences() == [[7, 8]]


# -- where it lives ------------------------------------------------------------


def test_default_path_is_keyed_by_the_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    path = default_path("m")
    assert path == default_path(str(tmp_path / "m")) == default_path("./m")  # one key per folder
    assert path.parent.parent == cache_root() / "datastore" and path.name == "history.bin"
    assert default_path("m", "built") == path.with_name("built.bin")
    assert default_path("default") != path and default_path("org/other").parent != path.parent
    with pytest.raises(RedrafterError, match="kind"):
        default_path("m", "nope")


# -- proposing -----------------------------------------------------------------


def test_propose_pads_and_needs_min_match():
    store = Datastore(model_id="m")
    for s in ([1, 2, 3, 4, 5], [1, 2, 3, 9], [0, 2, 3, 4, 6]):
        store.add(s)
    row, n, count = propose(store, [7, 2, 3], 4)
    # Three continuations of (2, 3), once each: the latest wins.
    assert row.tolist() == [4, 6, PAD, PAD] and (n, count) == (2, 1)
    row, n, count = propose(store, [7, 8, 3], 4)  # a 1-token match is too short by default
    assert row.tolist() == [PAD] * 4 and (n, count) == (0, 0)
    assert propose(store, [7, 8, 3], 2, min_match=1)[0].tolist() == [4, 6]


def test_store_lookup_has_lookups_interface():
    store = Datastore(model_id="m")
    for s in ([5, 1, 2, 3, 4], [6, 1, 2, 3, 9, 9], [7, 1, 2, 3, 4, 8]):
        store.add(s)
    lk = StoreLookup(store, [0, 0, 1])
    assert lk.propose(3) == []  # a 1-token suffix: no proposal
    lk.extend([2, 3])
    assert lk.propose(3, k=3) == [[4, 8, PAD], [9, 9, PAD], [4, PAD, PAD]]
    assert lk.last.length == 3 and [c for _, c in lk.last.continuations] == [1, 1, 1]
    assert all(len(r) == 5 for r in lk.propose(5, k=2))
