"""Distill and train over two processes started by ``mlx.launch --backend ring``
on 127.0.0.1, against the same work done by one process (tests/distributed_job.py)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import distributed_job as job
import mlx.core as mx
import numpy as np
import pytest

from mlx_redrafter.train.shards import Manifest, read_corpus

JOB = Path(job.__file__)
TOPICS = ["the sea", "a red fox", "bread", "primes", "the moon", "trains", "jazz", "rain", "chess"]


def launcher():
    """``mlx.launch`` of the interpreter running the tests (a venv whose MLX
    comes through a .pth file has no script of its own: run its module)."""
    script = Path(sys.executable).parent / "mlx.launch"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]


def free_ports(n):
    """A first port such that it and the next n - 1 are free on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n > 65535:
            continue
        try:
            socks = []
            for p in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


# A launch is judged by progress, not wall time: on a loaded machine (CI, a
# busy laptop) a rank may be slow, but it keeps printing progress lines. Only
# a launch whose log stops growing for STALL seconds is a hang. LIMIT bounds
# the whole launch all the same.
STALL = 240.0
LIMIT = 900.0


def last_words(text: str, n: int = 2) -> str:
    """What each rank was doing: its last progress line."""
    last = {}
    for line in text.splitlines():
        for r in range(n):
            if line.startswith(f"rank {r}/{n}"):
                last[r] = line
    return "\n".join(
        f"  rank {r}: {last.get(r, 'no output yet (not started, or stuck before importing)')}" for r in range(n)
    )


def wait_with_progress(p: subprocess.Popen, log: Path, n: int, stall: float, limit: float, armed=None) -> None:
    """Wait for ``p``; fail when its log makes no progress for ``stall`` s or the run exceeds ``limit`` s.
    ``armed``: a test of the log's text; until it holds, only ``limit`` applies."""
    start = last_change = time.monotonic()
    size, watching = -1, armed is None
    while p.poll() is None:
        now = time.monotonic()
        grown = log.stat().st_size
        if grown != size:
            size, last_change = grown, now
            watching = watching or armed(log.read_text())
        if (watching and now - last_change > stall) or now - start > limit:
            text = log.read_text()
            why = (
                f"no progress for {now - last_change:.0f} s"
                if now - last_change > stall
                else f"still running after {limit:.0f} s"
            )
            pytest.fail(
                f"mlx.launch hung ({why}). What each rank was doing:\n{last_words(text, n)}\n"
                f"Output of all ranks:\n{text}"
            )
        time.sleep(0.2)


def launch(tmp_path, *args, n=2, stall=STALL, limit=LIMIT, armed=None):
    """Run the job on n ranks; return the output of all ranks. Every process
    of the launch is killed, also on a hang or a failure. ``armed``: see
    :func:`wait_with_progress`."""
    log = tmp_path / "launch.log"
    cmd = [
        *launcher(),
        "-n",
        str(n),
        "--backend",
        "ring",
        "-p",
        str(free_ports(n)),
        "--",
        sys.executable,
        "-u",
        str(JOB),
        *map(str, args),
    ]
    with open(log, "w") as out:
        # stdin stays open: the launcher forwards it, and an exhausted stdin
        # would make it poll in a busy loop.
        p = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ),
        )
        try:
            wait_with_progress(p, log, n, stall, limit, armed)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the launcher and both ranks
            except ProcessLookupError:
                pass
            p.stdin.close()
            p.wait()
    return log.read_text()


def finished(output, n=2):
    return all(f"rank {r}/{n} done" in output for r in range(n))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"c{i}", "turns": [f"Tell me about {t}."]}) + "\n" for i, t in enumerate(TOPICS))
    )
    return path


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, prompts):
    """A folder distilled by two ranks, and the launch's output."""
    folder = tmp_path_factory.mktemp("dist")
    output = launch(folder, "distill", folder, "--prompts", prompts)
    assert finished(output), output
    return folder


def test_distill_shares_each_prompt_exactly_once(distilled, prompts):
    data = distilled / "data"
    merged = Manifest.load(data)
    assert merged.world_size == 2 and merged.sequences == len(TOPICS)
    ids = read_corpus(data).ids
    assert sorted(ids) == sorted(f"c{i}" for i in range(len(TOPICS)))  # each prompt exactly once
    for rank in (0, 1):  # by index modulo the world size
        part = read_corpus(data / f"rank-{rank}").ids
        assert part and all(int(cid[1:]) % 2 == rank for cid in part)


def test_distill_rerun_completes_only_the_missing_part(distilled, prompts, tmp_path):
    # Rank 1 died before writing its last shard: drop it from its manifest.
    part = distilled / "data" / "rank-1"
    m = Manifest.load(part)
    lost = json.loads(mx.load(str(part / m.shards[-1]), return_metadata=True)[1]["ids"])
    (part / m.shards.pop()).unlink()
    m.done = [c for c in m.done if c not in lost]
    m.sequences -= len(lost)
    m.save(part)
    before = {
        name: (distilled / "data" / "rank-0" / name).stat().st_mtime_ns
        for name in Manifest.load(distilled / "data" / "rank-0").shards
    }
    output = launch(tmp_path, "distill", distilled, "--prompts", prompts)
    assert finished(output), output
    assert sorted(read_corpus(distilled / "data").ids) == sorted(f"c{i}" for i in range(len(TOPICS)))
    after = {
        name: (distilled / "data" / "rank-0" / name).stat().st_mtime_ns
        for name in Manifest.load(distilled / "data" / "rank-0").shards
    }
    assert after == before  # rank 0 had nothing left to do


def weights(folder, step, rank):
    return {k: np.array(v) for k, v in mx.load(str(folder / f"weights-step{step}-rank{rank}.safetensors")).items()}


def test_train_matches_one_process_and_resumes(distilled, tmp_path):
    # Two ranks: 2 steps, interrupted, then resumed to step 4.
    out = tmp_path / "drafter2"
    output = launch(tmp_path, "train", distilled, "--out", out, "--stop-at", 2)
    assert "rank 0/2 interrupted" in output and "rank 1/2 interrupted" in output, output
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 2
    output = launch(tmp_path, "train", distilled, "--out", out, "--resume")
    assert finished(output), output
    # One process (no launch), the same batches with the same total batch size.
    single = tmp_path / "single"
    single.mkdir()
    (single / "data").symlink_to(distilled / "data")
    with pytest.raises(KeyboardInterrupt):
        job.run_train(single, tmp_path / "drafter1", stop_at=2)
    job.run_train(single, tmp_path / "drafter1", resume=True)
    for step in (2, 4):
        ref = weights(single, step, 0)
        r0, r1 = weights(distilled, step, 0), weights(distilled, step, 1)
        assert ref.keys() == r0.keys() == r1.keys()
        for k in ref:
            np.testing.assert_array_equal(r0[k], r1[k])  # the ranks agree exactly
            np.testing.assert_allclose(r0[k], ref[k], rtol=1e-4, atol=1e-5, err_msg=k)
    log = [json.loads(line) for line in open(out / "train_log.jsonl")]
    assert log[0]["world_size"] == 2


def test_a_rank_with_another_model_is_refused(distilled, tmp_path):
    output = launch(tmp_path, "train", distilled, "--out", tmp_path / "d", "--bad-rank", 1)
    assert "The model on rank 1 differs from rank 0's" in output and not finished(output), output
    assert "Traceback" not in output


def test_more_ranks_than_prompts_is_refused(tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"id": "only", "turns": ["Hello there."]}) + "\n")
    output = launch(tmp_path, "distill", tmp_path, "--prompts", one)
    assert "2 processes but only 1 conversation(s)" in output and not finished(output), output


def test_one_process_refuses_to_resume_a_two_process_folder(distilled, prompts):
    from mlx_redrafter import RedrafterError

    # The prompt shares depend on the number of processes.
    with pytest.raises(RedrafterError, match="distilled by 2 process"):
        job.run_distill(distilled, prompts)


def test_a_hung_launch_is_told_apart_and_says_what_each_rank_was_doing(tmp_path):
    # The stall is timed from both ranks' last line, so that a slow start (imports on
    # a loaded machine) is never taken for the hang: 5 s of silence then tell it.
    both_waiting = lambda text: text.count("waiting forever") == 2  # noqa: E731
    with pytest.raises(pytest.fail.Exception) as e:
        launch(tmp_path, "hang", tmp_path, stall=5, limit=120, armed=both_waiting)
    message = str(e.value)
    assert "no progress for" in message
    assert "rank 0: rank 0/2: waiting forever" in message and "rank 1: rank 1/2: waiting forever" in message
