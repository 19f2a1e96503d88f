"""Dynamic tree attention: official dedup parity and trie properties."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_redrafter.step.tree import PAD, count_nodes, count_rows, pack, prefix_tree

CASES = ["hand1", "hand2", "hand3", "bs_rnn_w1_row0", "bs_rnn_w2_row0", "bs_rnn_w4_row0"]


@pytest.mark.parametrize("case", CASES + ["batch2", "bs_rnn_w4_batch3"])
def test_prefix_tree_matches_official(ref, case):
    beams = ref[f"pk_{case}_beams"]
    for b in range(beams.shape[0]):
        got = np.array(prefix_tree(mx.array(beams[b])))
        np.testing.assert_array_equal(got, ref[f"pk_{case}_prefix_tree"][b])
        assert int(count_nodes(mx.array(beams[b]))) == ref[f"pk_{case}_n_selected"][b]


@pytest.mark.parametrize("case", CASES)
def test_beam_major_packing_matches_official(ref, case):
    """The official packer keeps the whole beam (root included) and orders
    row-major; ours with order='beam' after a dummy g0 gives the same arrays."""
    beams = mx.array(ref[f"pk_{case}_beams"][0])
    n = int(ref[f"pk_{case}_n_selected"][0])
    tree = pack(beams, n, mx.array(-1), order="beam")
    np.testing.assert_array_equal(np.array(tree.tokens[1:]), ref[f"pk_{case}_packed_beams"][0])
    np.testing.assert_array_equal(np.array(tree.node_index) - 1, ref[f"pk_{case}_unpacker"][0])
    np.testing.assert_array_equal(np.array(tree.depth[1:]) - 1, ref[f"pk_{case}_position_offsets"][0])
    np.testing.assert_array_equal(np.array(tree.mask[1:, 1:]), ref[f"pk_{case}_tree_mask"][0])


@pytest.mark.parametrize("case", CASES)
def test_depth_major_packing_is_the_same_tree(ref, case):
    beams = mx.array(ref[f"pk_{case}_beams"][0])
    n = int(ref[f"pk_{case}_n_selected"][0])
    tree = pack(beams, n, mx.array(-1))
    depth = np.array(tree.depth)
    assert (np.diff(depth) >= 0).all()  # depth-major
    packed = np.array(tree.tokens)
    np.testing.assert_array_equal(packed[np.array(tree.node_index)], np.array(beams))
    assert sorted(packed[1:].tolist()) == sorted(ref[f"pk_{case}_packed_beams"][0].tolist())


# --------------------------------------------------------------------------- properties


def trie_of(beams):
    """A reference trie: prefix tuple -> set of ancestor prefixes."""
    nodes = {}
    for beam in beams:
        for j in range(len(beam)):
            prefix = tuple(beam[: j + 1])
            nodes[prefix] = {tuple(beam[: k + 1]) for k in range(j)}
    return nodes


beam_sets = st.integers(1, 5).flatmap(
    lambda width: st.integers(1, 6).flatmap(
        lambda length: st.lists(
            st.lists(st.integers(0, 3), min_size=length, max_size=length),
            min_size=width,
            max_size=width,
        )
    )
)


@settings(max_examples=150, deadline=None)
@given(beam_sets, st.sampled_from(["depth", "beam"]))
def test_packing_is_a_trie(beams, order):
    trie = trie_of(beams)
    arr = mx.array(beams, dtype=mx.int32)
    n = int(count_nodes(arr))
    assert n == len(trie)  # packed size == number of distinct prefixes
    tree = pack(arr, n, mx.array(99), order=order)
    tokens = np.array(tree.tokens)
    node_index = np.array(tree.node_index)
    mask = np.array(tree.mask)
    depth = np.array(tree.depth)
    parent = np.array(tree.parent)
    assert tokens[0] == 99 and depth[0] == 0
    # Every distinct prefix appears exactly once.
    prefix_of = {}
    for w, beam in enumerate(beams):
        for j in range(len(beam)):
            idx = node_index[w, j]
            assert tokens[idx] == beam[j] and depth[idx] == j + 1
            prefix_of.setdefault(idx, tuple(beam[: j + 1]))
            assert prefix_of[idx] == tuple(beam[: j + 1])
            assert parent[idx] == (node_index[w, j - 1] if j else 0)
    assert sorted(prefix_of) == list(range(1, n + 1))
    assert len(set(prefix_of.values())) == n
    # Ancestors are right: the mask row is exactly self + ancestors + g0.
    for idx, prefix in prefix_of.items():
        want = {0, idx} | {i for i, p in prefix_of.items() if p in trie[prefix]}
        assert set(np.nonzero(mask[idx])[0].tolist()) == want
    assert mask[0].tolist() == [True] + [False] * n


padded_sets = st.integers(1, 5).flatmap(
    lambda length: st.lists(
        st.lists(st.integers(0, 3), min_size=1, max_size=length).map(lambda b: b + [PAD] * (length - len(b))),
        min_size=1,
        max_size=5,
    )
)


@settings(max_examples=100, deadline=None)
@given(padded_sets)
def test_padded_beams_pack_as_the_trie_of_their_tokens(beams):
    """Beams of different lengths (PAD after the end): the same tree as their unpadded tokens."""
    real = [[t for t in b if t != PAD] for b in beams]
    trie = trie_of(real)
    n = count_rows(beams)
    assert n == len(trie)
    tree = pack(mx.array(beams, dtype=mx.int32), n, mx.array(99), padded=True)
    tokens, node_index, depth = np.array(tree.tokens), np.array(tree.node_index), np.array(tree.depth)
    mask, parent = np.array(tree.mask), np.array(tree.parent)
    assert tree.size == n + 1 and (tokens[1:] >= 0).all()
    prefix_of = {}
    for w, beam in enumerate(beams):
        for j, t in enumerate(beam):
            idx = node_index[w, j]
            if t == PAD:
                assert idx == 0
                continue
            assert tokens[idx] == t and depth[idx] == j + 1
            assert parent[idx] == (node_index[w, j - 1] if j else 0)
            prefix_of.setdefault(idx, tuple(beam[: j + 1]))
            assert prefix_of[idx] == tuple(beam[: j + 1])
    assert sorted(prefix_of) == list(range(1, n + 1))
    for idx, prefix in prefix_of.items():
        want = {0, idx} | {i for i, p in prefix_of.items() if p in trie[prefix]}
        assert set(np.nonzero(mask[idx])[0].tolist()) == want
