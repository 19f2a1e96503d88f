"""The queue of ``serve``: who decodes, who waits, who is turned away.

One worker thread runs a *decoder* (the batch of
:mod:`~mlx_redrafter.serve.batch`, or :class:`SerialDecoder`, one job at a
time through a handler). The :class:`Scheduler` holds what the decoder does
not: at most ``max_batch`` requests decode at once and ``size`` more wait,
first come first served (the oldest waiting request joins first, so none
starves); past both bounds :meth:`Scheduler.submit` raises
:class:`QueueFull` with a ``retry_after`` in seconds, estimated from the
measured time per request. A decoder may take fewer rows than there are
free places (:meth:`capacity`: the batch's rule says when decoding together
pays); the others wait.

A decoder has ``active`` (rows decoding), ``capacity(wanting) -> rows``,
``admit(jobs)``, ``step() -> (finished, rows advanced)`` with ``finished``
a list of ``(job, Result or None)`` (None: the job failed and was told;
jobs that failed to join are reported by the next step), and
``fail(error) -> finished`` for when a step raised.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Callable, Dict, List, Optional, Tuple

from ..errors import RedrafterError
from .jobs import Job, Result

# The measured seconds per request follow the last requests (an exponential
# average: each new one weighs this much).
REQUEST_WEIGHT = 0.2


class QueueFull(Exception):
    """The server holds its bound of decoding and waiting requests;
    ``retry_after``: seconds until a place is likely free (HTTP ``Retry-After``)."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


Finished = List[Tuple[Job, Optional[Result]]]


def tell(job: Job, kind: str, value) -> None:
    """Emit to a job whose listener may be gone (the server is stopping)."""
    try:
        job.emit(kind, value)
    except Exception:
        pass


class Scheduler:
    """Jobs through ``decoder`` on one worker thread: at most ``max_batch``
    decoding and ``size`` waiting. ``step_listeners`` get the rows each step
    advanced, ``shed_listeners`` are called for each refused job (metrics)."""

    def __init__(self, decoder, size: int):
        if size < 1:
            raise RedrafterError(f"The queue size must be at least 1 (got {size}).")
        self.decoder, self.size, self.max_batch = decoder, size, decoder.max_batch
        self._cond = threading.Condition()
        self._waiting: "deque[Job]" = deque()
        self._live: set = set()  # submitted and not finished
        self._started: Dict[Job, float] = {}
        self.served = self.cancelled = self.shed = 0
        self.batch = 0  # rows the last step advanced
        self.request_s = 0.0  # measured seconds per request (0: none finished yet)
        self.step_listeners: List[Callable[[int], None]] = []
        self.shed_listeners: List[Callable[[], None]] = []
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ clients' side

    def submit(self, job: Job) -> None:
        """Queue ``job``; :class:`QueueFull` when ``max_batch + size`` jobs are in already."""
        with self._cond:
            full = len(self._live) >= self.max_batch + self.size
            if full:
                self.shed += 1
                error = QueueFull(
                    f"{self.decoder.active} requests are decoding and {len(self._waiting)} waiting "
                    f"(the bounds are {self.max_batch} and {self.size}).",
                    self.retry_after(),
                )
            else:
                self._live.add(job)
                self._waiting.append(job)
                self._cond.notify()
        if full:
            for listener in self.shed_listeners:
                listener()
            raise error

    def retry_after(self) -> int:
        """Seconds until a new request would likely find a place: the measured
        time per request (before any finished, the oldest running one's time
        so far) for each round of ``max_batch`` requests ahead of it."""
        per = self.request_s
        if not per:
            now = time.perf_counter()
            per = max((now - t for t in self._started.values()), default=1.0)
        return max(1, math.ceil(per * (len(self._waiting) + 1) / self.max_batch))

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="redrafter-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Cancel every job (the decoding ones stop at their next step) and end the worker."""
        with self._cond:
            for job in self._live:
                job.cancel()
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def status(self) -> dict:
        with self._cond:
            active = self.decoder.active
            return {
                "waiting": len(self._waiting),
                "running": active,
                "active": active,
                "max_batch": self.max_batch,
                "bound": self.size,
                "served": self.served,
                "cancelled": self.cancelled,
                "shed": self.shed,
                "batch": self.batch,
                "seconds_per_request": round(self.request_s, 3),
            }

    # ------------------------------------------------------------------ the worker

    def _next_jobs(self) -> Optional[List[Job]]:
        """The waiting jobs that join now (oldest first); blocks while idle; None: stop."""
        with self._cond:
            while not (self._stopping or self._waiting or self.decoder.active):
                self._cond.wait()
            if self._stopping:  # every job is cancelled: the waiting ones are skipped at once
                if not (self._waiting or self.decoder.active):
                    return None
                jobs, self._waiting = list(self._waiting), deque()
                return jobs
            active = self.decoder.active
            room = self.decoder.capacity(len(self._waiting) + active) - active
            return [self._waiting.popleft() for _ in range(min(max(room, 0), len(self._waiting)))]

    def _work(self) -> None:
        while True:
            jobs = self._next_jobs()
            if jobs is None:
                return
            skipped = [(job, Result(cancelled=True)) for job in jobs if job.cancelled.is_set()]
            for job, res in skipped:  # its client left while it waited
                tell(job, "done", res)
            admit = [job for job in jobs if not job.cancelled.is_set()]
            now = time.perf_counter()
            finished: Finished = list(skipped)
            advanced = 0
            try:
                if admit:
                    with self._cond:
                        self._started.update((job, now) for job in admit)
                    self.decoder.admit(admit)
                if self.decoder.active or admit:  # a step also reports the rows that failed to join
                    done, advanced = self.decoder.step()
                    finished += done
            except BaseException as e:  # the worker must survive any request
                finished += self.decoder.fail(e)
            self._finished(finished, advanced)

    def _finished(self, finished: Finished, advanced: int) -> None:
        now = time.perf_counter()
        with self._cond:
            self.batch = advanced
            for job, res in finished:
                self._live.discard(job)
                started = self._started.pop(job, None)
                self.served += 1
                self.cancelled += int(res is not None and res.cancelled)
                if started is not None and res is not None and not res.cancelled:
                    s = now - started
                    self.request_s = (
                        s if not self.request_s else (1 - REQUEST_WEIGHT) * self.request_s + REQUEST_WEIGHT * s
                    )
        if advanced:
            for listener in self.step_listeners:
                listener(advanced)


class SerialDecoder:
    """One job at a time, run whole by ``handler(job) -> Result`` (which
    emits its own events): the decoder of :class:`JobQueue`."""

    max_batch = 1

    def __init__(self, handler: Callable[[Job], Result]):
        self.handler = handler
        self.current: Optional[Job] = None

    @property
    def active(self) -> int:
        return int(self.current is not None)

    def capacity(self, wanting: int) -> int:
        return 1

    def admit(self, jobs: List[Job]) -> None:
        (self.current,) = jobs

    def step(self) -> Tuple[Finished, int]:
        job = self.current
        if job is None:
            return [], 0
        try:
            return [(job, self.handler(job))], 1
        except BaseException as e:
            tell(job, "error", e)
            return [(job, None)], 1
        finally:
            self.current = None

    def fail(self, error: BaseException) -> Finished:
        job, self.current = self.current, None
        if job is None:
            return []
        tell(job, "error", error)
        return [(job, None)]


class JobQueue(Scheduler):
    """First come, first served through ``handler``, one job at a time, with
    at most ``size`` jobs waiting behind the running one."""

    def __init__(self, handler: Callable[[Job], Result], size: int):
        super().__init__(SerialDecoder(handler), size)
