"""The thread a :class:`~kvcanary_cupy.distributed.RankReducer` runs its reductions on.

One long-lived daemon thread per session, started by the first reduction: ``end_step`` on the
step's thread only hands it a job (a callable) and later picks up the job's result, so that
issuing the collective (torch's and NCCL's or gloo's host calls) and decoding the reduced rows
stay off the step's critical path.  At most one job is in flight: the reducer reads a result
before it submits the next job, so the job's buffers are never shared with a running one.

A job's exception is kept and raised by :meth:`ReductionWorker.result` on the step's thread.
Every wait is bounded: a job still running after ``timeout_s`` raises a ``TimeoutError`` naming
the job instead of hanging.  :meth:`close` (the session's ``close()``, its garbage collection,
interpreter exit) stops the thread after its current job.
"""

from __future__ import annotations

import logging
import queue
import threading

logger = logging.getLogger("kvcanary_cupy")

_STOP = object()


class ReductionWorker:
    """A daemon thread running one job at a time; ``submit``, ``ready``, ``result``, ``close``."""

    def __init__(self, name: str, timeout_s: float, setup=None):
        self.name, self.timeout_s = name, float(timeout_s)
        self._setup = setup  # run once on the thread before its first job (e.g. its CUDA device)
        # two C queues, no Event/Condition: the cheapest hand-over each way for the step's thread
        self._jobs, self._results = queue.SimpleQueue(), queue.SimpleQueue()
        self._thread = None
        self._what = None  # what the job in flight does, for the errors
        self._landed = None  # (value, error) of the job in flight, once taken from _results
        self._closed = False

    @property
    def thread(self):
        """The thread (None before the first job)."""
        return self._thread

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, job, what: str) -> None:
        """Run ``job()`` on the thread; ``what`` names it in errors.  The previous result must have been read."""
        if self._closed:
            raise RuntimeError(f"kv-canary: {self.name} is closed (session.close() was called); no more reductions")
        if self._what is not None:
            raise RuntimeError(f"kv-canary: {self.name} got a job while {self._what} was not read")
        if self._thread is None:
            self._thread = threading.Thread(target=_run, args=(self._jobs, self._results, self._setup), name=self.name,
                                            daemon=True)
            self._thread.start()
        self._what = what
        self._jobs.put(job)

    def pending(self) -> bool:
        """Whether a job was submitted and its result not read yet."""
        return self._what is not None

    def ready(self) -> bool:
        """Whether the job in flight has finished (its result can be read without waiting)."""
        return self._landed is not None or not self._results.empty()

    def wait(self) -> None:
        """Wait (at most ``timeout_s``) until the job in flight has finished, leaving its result to :meth:`result`."""
        if self._landed is None:
            try:
                self._landed = self._results.get(timeout=self.timeout_s)
            except queue.Empty:
                raise TimeoutError(f"kv-canary: {self._what} did not finish within {self.timeout_s:.0f} s on thread "
                                   f"{self.name!r} (a peer rank stopped issuing the canary's collective, or the "
                                   "collective hangs)") from None

    def result(self):
        """The job's return value, waiting at most ``timeout_s``; raises what the job raised (a
        ValueError as it was, anything else as a RuntimeError naming the job) or TimeoutError."""
        self.wait()
        what, (value, error) = self._what, self._landed
        self._what = self._landed = None
        if error is None:
            return value
        if isinstance(error, ValueError):  # the reducer's own checks (ranks disagreeing): as raised
            raise error
        raise RuntimeError(f"kv-canary: {what} failed on thread {self.name!r}: {type(error).__name__}: {error}") from error

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread after its current job (waiting at most ``timeout_s``); idempotent."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is None:
            return
        self._jobs.put(_STOP)
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("kv-canary: %s is still running %s after %.0f s; left behind (a daemon thread)",
                           self.name, self._what or "a job", timeout_s)


def _run(jobs, results, setup) -> None:
    """The thread's loop; it holds no reference to the reducer or the session between jobs."""
    setup_error = None
    if setup is not None:
        try:
            setup()
        except BaseException as exc:  # raised with the first job's result
            setup_error = exc
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        if setup_error is not None:
            landed = (None, setup_error)
        else:
            try:
                landed = (job(), None)
            except BaseException as exc:
                landed = (None, exc)
        job = None  # drop the job's references before waiting for the next one
        results.put(landed)
        landed = None
