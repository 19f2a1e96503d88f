"""Break the product on purpose, one mutation at a time, and see which tests notice.

    python bench/mutations.py                 # every mutation, each with the test files that guard it
    python bench/mutations.py --only H1 H4    # some of them
    python bench/mutations.py --list          # what each one breaks
    python bench/mutations.py --only H1 --tests tests/test_sources.py -- -k anywhere   # one guard alone

Each mutation is a small edit of the product code (one or a few exact text
replacements) that changes what users get without crashing: a recurrent
state taken from the wrong tree node, features that never reach a draft
head, a flag accepted and ignored. For each, the worktree is copied to a
scratch folder, the edit applied there (a text that is not found exactly
once is reported, not guessed), and the test files that guard that code run
against the copy (``PYTHONPATH`` at it). A mutation is **caught** when
those tests fail; the failing tests are printed. The repository itself is
never edited.

A test file that guards exactness says in its tests which of these it was
seen to catch; a new guard adds its mutation here (the habit of issue 53).
Exit status: 1 if a mutation was not caught (or could not be applied).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Mutation:
    name: str
    what: str  # what users would get
    file: str  # relative to the repository
    edits: List[Tuple[str, str]]  # (exact text, its replacement), each found exactly once
    tests: List[str]  # the test files (pytest arguments) that guard it


MUTATIONS = [
    Mutation(
        "H1",
        "a recurrent layer's state taken from the first node of the accepted depth",
        "mlx_redrafter/step/mixers.py",
        [("mx.minimum(place, e.shape[0] - 1)", "mx.minimum(place * 0, e.shape[0] - 1)")],
        ["tests/test_hybrid.py", "tests/test_sources.py"],
    ),
    Mutation(
        "H2",
        "zeros instead of the target's features handed to a layer head after each step",
        "mlx_redrafter/step/after_read.py",
        [
            (
                "drafts.entered([self.g0_val] + read.row[: read.n], hidden[mx.array(read.path[: read.n + 1], mx.int32)])",  # noqa: E501
                "drafts.entered([self.g0_val] + read.row[: read.n], mx.zeros_like(hidden[mx.array(read.path[: read.n + 1], mx.int32)]))",  # noqa: E501
            )
        ],
        ["tests/test_head_features.py", "tests/test_sources.py", "tests/test_eagle3_draft.py"],
    ),
    Mutation(
        "H3",
        "an EAGLE-3 head's three taps fused in reverse order",
        "mlx_redrafter/step/drafts.py",
        [("idx = [layers.index(t) for t in wanted] +", "idx = [layers.index(t) for t in wanted][::-1] +")],
        ["tests/test_head_features.py", "tests/test_eagle3_draft.py"],
    ),
    Mutation(
        "H4",
        "the default body bound ten times larger than documented",
        "mlx_redrafter/serve/limits.py",
        [("BYTES_PER_TOKEN = 64\n", "BYTES_PER_TOKEN = 640\n")],
        ["tests/test_server_limits.py"],
    ),
    Mutation(
        "H5",
        "the depth gate fed zeros instead of a layer head's confidences",
        "mlx_redrafter/draft/head.py",
        [
            (
                "gate.drafted(depth, _confidences(logp, total, vocab, gate.controller.top_k))",
                "gate.drafted(depth, mx.zeros((gate.controller.top_k,)))",
            )
        ],
        ["tests/test_head_features.py", "tests/test_eagle3_draft.py"],
    ),
    Mutation(
        "H6",
        "serve (and generate, chat) no longer check the resolved draft at start-up",
        "mlx_redrafter/runtime.py",
        [("    rt.plan()  # the one check of a draft", "    pass  # the one check of a draft")],
        ["tests/test_one_check.py"],
    ),
    Mutation(
        "C1",
        "the last tree node's recurrent state kept instead of the accepted one's (read, then build)",
        "mlx_redrafter/step/mixers.py",
        [
            (
                "return [None if e is None else mx.take(e, node, axis=0) for e in self.entries]",
                "return [None if e is None else e[-1:] for e in self.entries]",
            )
        ],  # fmt: skip
        ["tests/test_hybrid.py"],
    ),
    Mutation(
        "C2",
        "a stateful source's cache not trimmed after a chain drafted in it",
        "mlx_redrafter/draft/chain.py",
        [("            c.trim(written)\n", "            c.trim(0)\n")],
        ["tests/test_sources.py", "tests/test_eagle3_draft.py", "tests/test_head_features.py"],
    ),
    Mutation(
        "C3",
        "an EAGLE-3 head's reduced vocabulary mapped without d2t's offsets",
        "mlx_redrafter/draft/eagle3.py",
        [
            (
                "return mx.arange(self.config.draft_vocab_size, dtype=mx.int32) + self.d2t",
                "return mx.arange(self.config.draft_vocab_size, dtype=mx.int32) + self.d2t * 0",
            )
        ],  # fmt: skip
        ["tests/test_eagle3_draft.py", "tests/test_head_features.py"],
    ),
    Mutation(
        "C4",
        "an MTP head's two input norms swapped",
        "mlx_redrafter/draft/mtp.py",
        [
            (
                "e, hid = self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(",
                "e, hid = self.pre_fc_norm_hidden(emb), self.pre_fc_norm_embedding(",
            )
        ],  # fmt: skip
        ["tests/test_mtp.py"],
    ),
    Mutation(
        "C5",
        "an EAGLE-3 head's embedding and state norms swapped",
        "mlx_redrafter/draft/eagle3.py",
        [
            ("normed = self.hidden_norm(hidden)", "normed = self.input_layernorm(hidden)"),
            ("[self.input_layernorm(embeds), normed]", "[self.hidden_norm(embeds), normed]"),
        ],
        ["tests/test_eagle3.py", "tests/test_eagle3_draft.py"],
    ),
    Mutation(
        "C6",
        "a configured --max-body-bytes bound ten times larger",
        "mlx_redrafter/serve/app.py",
        [
            (
                "bound = max_body_bytes or default_body_bytes(",
                "bound = (max_body_bytes or 0) * 10 or default_body_bytes(",
            )
        ],
        ["tests/test_server_limits.py"],
    ),
    Mutation(
        "C7",
        "a draft model's beams drafting into its committed cache (a CacheList's members shared: Falcon-H1)",
        "mlx_redrafter/draft/head.py",
        [("    if isinstance(members, (list, tuple)):\n", "    if False:\n")],
        ["tests/test_hybrid.py"],
    ),
    Mutation(
        "C8",
        "the accepted path read from the first beam, whatever beam was accepted (greedy)",
        "mlx_redrafter/step/accept.py",
        [
            (
                "    path = _path(node_index, beam, n)\n    last = path[-1]\n    return Accepted(",
                "    path = _path(node_index, beam * 0, n)\n    last = path[-1]\n    return Accepted(",
            )
        ],  # fmt: skip
        ["tests/test_hybrid.py", "tests/test_pipeline.py", "tests/test_exactness.py"],
    ),
]


def scratch_copy(root: Path) -> Path:
    """The worktree (no git data, no caches) copied under ``root``."""
    dest = root / "repo"
    shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", ".venv"))
    return dest


def apply(mutation: Mutation, repo: Path) -> str:
    """Apply ``mutation`` in ``repo``; the problem, or "" when applied."""
    path = repo / mutation.file
    text = path.read_text()
    for old, new in mutation.edits:
        count = text.count(old)
        if count != 1:
            return f"{mutation.file}: {old!r} found {count} times"
        text = text.replace(old, new)
    path.write_text(text)
    return ""


def run(mutation: Mutation, python: str, extra: List[str], tests=None) -> Tuple[str, List[str], float]:
    """``(verdict, failing tests, seconds)`` of one mutation."""
    with tempfile.TemporaryDirectory(prefix=f"mutation-{mutation.name}-") as tmp:
        repo = scratch_copy(Path(tmp))
        problem = apply(mutation, repo)
        if problem:
            return f"NOT APPLIED ({problem})", [], 0.0
        env = dict(os.environ, PYTHONPATH=str(repo))
        cmd = [
            python,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--maxfail=3",
            "-rf",
            *(tests or mutation.tests),
            *extra,
        ]
        tic = time.monotonic()
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
        seconds = time.monotonic() - tic
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    if proc.returncode == 0:
        return "NOT CAUGHT", [], seconds
    if not failed:  # errors, not failures: say so rather than count it
        tail = "\n".join(proc.stdout.splitlines()[-5:])
        return f"ERROR (rc {proc.returncode})\n{tail}", [], seconds
    return "caught", failed, seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Apply each mutation on a scratch copy and run its guarding tests.")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="Run these mutations only (e.g. H1 C4).")
    parser.add_argument("--list", action="store_true", help="List the mutations and exit.")
    parser.add_argument("--python", default=sys.executable, help="The Python that runs pytest.")
    parser.add_argument("--tests", nargs="+", metavar="FILE", help="Run these test files instead of each one's own.")
    parser.add_argument("pytest_args", nargs="*", help="Extra pytest arguments (after --), e.g. -k anywhere.")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}  {m.what}  ({m.file}; {' '.join(m.tests)})")
        return 0
    missed = 0
    for m in chosen:
        verdict, failed, seconds = run(m, args.python, args.pytest_args, args.tests)
        missed += verdict != "caught"
        print(f"{m.name}  {verdict}  ({seconds:.0f} s)  {m.what}", flush=True)
        for test in failed:
            print(f"      {test}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
