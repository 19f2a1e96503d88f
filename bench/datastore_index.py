"""Micro-benchmark: the datastore index's build and query times (no model).

    python bench/datastore_index.py                 # 200k tokens in 1000 sequences
    python bench/datastore_index.py --tokens 1000000

The store holds Zipf-distributed token ids (exponent 1.3, a skew like text's),
so short suffixes occur thousands of times: the slow case for counting
continuations. Queries: histories ending inside a stored sequence (long,
rare matches), fresh Zipf histories (short, frequent matches) and the most
frequent token alone (the worst case). CPU time, best of 5.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mlx_redrafter.draft.datastore.index import Datastore


def best_time(fn, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        tic = time.process_time()
        fn()
        best = min(best, time.process_time() - tic)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--length", type=int, default=200, help="tokens per sequence")
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    store = Datastore(max_tokens=args.tokens, model_id="bench")
    for _ in range(args.tokens // args.length):
        store.add(np.minimum(rng.zipf(1.3, args.length), args.vocab - 1))
    build = best_time(lambda: (store.add([1, 2]), store.match([1, 2])))
    print(f"{store.tokens} tokens in {len(store)} sequences: index build {build * 1e3:.0f} ms")
    seqs = [s for s in store.sequences() if len(s) > 20]
    inside = []
    for _ in range(500):
        s = seqs[int(rng.integers(len(seqs)))]
        end = int(rng.integers(20, len(s)))
        inside.append(s[end - 20 : end])
    fresh = [np.minimum(rng.zipf(1.3, 20), args.vocab - 1).tolist() for _ in range(500)]
    worst = [[1]] * 100  # a 1-token match of the most frequent token
    for name, hs in [
        ("inside stored sequences", inside),
        ("fresh Zipf histories", fresh),
        ("the top token alone", worst),
    ]:
        found = [store.match(h) for h in hs]
        t = best_time(lambda: [store.match(h, max_continuations=4, length=4) for h in hs]) / len(hs)
        print(
            f"{name}: {t * 1e6:.0f} us/match, mean match {np.mean([m.length for m in found]):.1f} tokens, "
            f"median occurrences {np.median([m.occurrences for m in found]):.0f}"
        )


if __name__ == "__main__":
    main()
