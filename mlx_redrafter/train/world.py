"""The processes a run is spread over: one, or several started by ``mlx.launch``.

``mx.distributed.init()`` gives a group of size 1 when the program was not
launched, so distillation and training have one code path: with one process
every helper here returns its input without communicating, and with several
they use MLX's own collectives (ring over TCP, MPI or NCCL, as ``mlx.launch``
chose).

Every check that can fail is decided together: each rank contributes what it
saw, all ranks get the same answer and raise the same error, so a bad rank
never leaves the others waiting in a collective.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import RedrafterError

# The digests that runs agree on: the drafter store keys models by the same fingerprint.
from ..llm.identity import digest  # noqa: F401 (re-exported)
from ..llm.identity import weights_fingerprint as model_fingerprint  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class World:
    group: object  # mx.distributed.Group
    rank: int
    size: int

    @property
    def label(self) -> str:
        """``rank R/N`` for progress lines and logs."""
        return f"rank {self.rank}/{self.size}"

    def sum(self, x: mx.array) -> mx.array:
        """``all_sum`` over the ranks (the input itself for one process)."""
        return x if self.size == 1 else mx.distributed.all_sum(x, group=self.group)

    def mean(self, tree):
        """The mean over the ranks of a tree of arrays of one dtype (gradients).

        One ``all_sum`` over all of them concatenated: inside a compiled
        step, several collectives (``nn.average_gradients``, one per array)
        left the ranks hanging with MLX 0.32 on the CPU; a single one runs.
        """
        if self.size == 1:
            return tree
        flat = tree_flatten(tree)
        total = self.sum(mx.concatenate([v.reshape(-1) for _, v in flat])) / self.size
        out, start = [], 0
        for name, v in flat:
            out.append((name, total[start : start + v.size].reshape(v.shape)))
            start += v.size
        return tree_unflatten(out)

    def from_rank0(self, tree):
        """Rank 0's copy of a tree of arrays on every rank (same structure and
        shapes everywhere). Adding zeros is exact, so this is a broadcast."""
        if self.size == 1:
            return tree
        if isinstance(tree, mx.array):
            return self.sum(tree if self.rank == 0 else mx.zeros_like(tree))
        # One array at a time, in name order: the ranks may hold the same
        # tree in another key order (a loaded checkpoint), and collectives
        # must meet in the same order on every rank.
        flat = dict(tree_flatten(tree))
        for name in sorted(flat):
            flat[name] = self.from_rank0(flat[name])
            mx.eval(flat[name])
        return tree_unflatten(list(flat.items()))

    def gather_json(self, obj) -> List:
        """Every rank's ``obj`` (JSON-serializable), in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        data = np.frombuffer(json.dumps(obj).encode(), np.uint8).astype(np.int32)
        lengths = mx.distributed.all_gather(mx.array([len(data)], mx.int32), group=self.group).tolist()
        padded = np.zeros(max(lengths), np.int32)
        padded[: len(data)] = data
        rows = np.array(mx.distributed.all_gather(mx.array(padded), group=self.group)).reshape(self.size, -1)
        return [json.loads(row[:n].astype(np.uint8).tobytes().decode()) for row, n in zip(rows, lengths)]

    def share_json(self, obj):
        """Rank 0's ``obj`` on every rank."""
        return obj if self.size == 1 else self.gather_json(obj if self.rank == 0 else None)[0]

    def barrier(self) -> None:
        """Return once every rank got here."""
        if self.size > 1:
            mx.eval(self.sum(mx.array(0, mx.int32)))

    def check(self, error: Optional[RedrafterError]) -> None:
        """Raise on every rank when any rank found an error (its own first)."""
        found = [(error.problem, error.fix)] if error else []
        everyone = self.gather_json(found) if self.size > 1 else [found]
        for rank, errs in enumerate(everyone):
            if errs:
                ((message, fix),) = errs
                where = "" if self.size == 1 or rank == self.rank else f"Rank {rank}: "
                raise RedrafterError(where + message, fix)

    def agree(self, fingerprints: dict) -> None:
        """Raise on every rank when a rank's fingerprint (``{what: digest}``)
        differs from rank 0's: its model or data is not rank 0's."""
        if self.size == 1:
            return
        everyone = self.gather_json(fingerprints)
        for name in fingerprints:
            bad = [r for r, fp in enumerate(everyone) if fp.get(name) != everyone[0].get(name)]
            if bad:
                ranks = ", ".join(map(str, bad))
                raise RedrafterError(
                    f"The {name} on rank {ranks} differs from rank 0's ({len(bad)} of {self.size} ranks).",
                    f"Give every machine the same {name} (same files, same package version) and relaunch.",
                )


@lru_cache(maxsize=1)
def world() -> World:
    """This process's place in the run (rank 0 of 1 without ``mlx.launch``)."""
    group = mx.distributed.init()
    return World(group, group.rank(), group.size())
