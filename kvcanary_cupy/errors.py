"""One place for the errors this library raises: the ``kv-canary:`` prefix of every argument
error (and where its traceback points), and the session's own exceptions.

Argument checks live in shared helpers (validation, interop, the records); a traceback ending in
one of them shows the reader kv-canary's internals instead of the call they made.  Public entry
points are decorated with :func:`public_api`, which cuts the traceback of the errors raised by
:func:`fail` at the entry point's own frame.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from .reporting import ViolationReport

_MARK = "_kvcanary_argument_error"


def fail(exc_type: type[Exception], message: str) -> NoReturn:
    exc = exc_type(f"kv-canary: {message}")
    setattr(exc, _MARK, True)
    raise exc


def public_api(fn):
    """Make the argument errors raised inside ``fn`` end their traceback at ``fn``'s frame.

    Other exceptions (bugs, CUDA errors) keep their whole traceback.  Nested entry points (a
    planner calling :func:`kvcanary_cupy.plan`) cut at the outermost one.  The bound launchers'
    calls, whose whole cost is a few microseconds, do the same inline (:func:`trimmed_argument_error`)
    instead of paying for a wrapper's frame.
    """
    code = fn.__code__

    @functools.wraps(fn)
    def entry_point(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (TypeError, ValueError) as exc:
            if not getattr(exc, _MARK, False):
                raise
            tb = exc.__traceback__
            while tb is not None and tb.tb_frame.f_code is not code:
                tb = tb.tb_next
            if tb is None:
                raise
            tb.tb_next = None
            raise exc.with_traceback(tb)  # noqa: B904 - the same exception, trimmed

    return entry_point


def trimmed_argument_error(exc: BaseException):
    """:func:`public_api` inline, for an entry point that catches ``(TypeError, ValueError)`` itself:
    ``exc`` with its traceback ending at the catching frame when it is an argument error (raise it),
    else None (re-raise as it is)::

        except (TypeError, ValueError) as exc:
            trimmed = trimmed_argument_error(exc)
            if trimmed is None:
                raise
            raise trimmed
    """
    if not getattr(exc, _MARK, False):
        return None
    tb = exc.__traceback__  # its first entry is the frame that caught it
    tb.tb_next = None
    return exc.with_traceback(tb)


class CanaryViolationError(RuntimeError):
    """New KV-canary violations under ``on_violation="raise"``; ``report`` lists them.

    Raised by :meth:`CanarySession.end_step` and :meth:`CanarySession.check` when the steps they
    handled found violations not seen before; the message lists the first of them.

    Parameters
    ----------
    message : str
        The one-line summary and the first violations, one per line.
    report : ViolationReport
        The new violations (with their repeats and batch rows) and the session's totals.

    Examples
    --------
    >>> try:                                        # doctest: +SKIP
    ...     session.end_step()
    ... except kc.CanaryViolationError as exc:
    ...     exc.report.to_pandas()
    """

    def __init__(self, message: str, report: "ViolationReport"):
        super().__init__(message)
        self.report = report


class CanaryHealthError(RuntimeError):
    """The canary did not run: no canary kernel of a launch tag ran between two ``end_step`` calls.

    Raised by :meth:`CanarySession.end_step` / :meth:`CanarySession.check` under
    ``on_violation="raise"`` (counted in ``stats["health_failures"]`` under the other policies):
    a step whose HEAD or TAIL kernels never ran, e.g. a CUDA graph replayed without the canary's
    launches in it, would otherwise pass silently.
    """


class CanaryUsageError(RuntimeError):
    """A session's methods were called out of order (the message names the expected order), or
    ``end_step``/``check``/``sweep`` from inside the session's own ``on_violation`` callback."""


class CanaryCoverageWarning(UserWarning):
    """Something the canary was asked to check was not checked: plan inputs or kernel items out of
    range of the canary (a canary smaller than the pool it guards), or violation keys evicted from a
    session's full distinct table.  Warned once per session; the counts are in ``stats``."""


class CanaryCapacityWarning(UserWarning):
    """A capacity was clamped (a negative or too large value) or the verify plan overflowed.

    Warned once by :class:`CanaryPlanner` when its :class:`CanaryCapacities` carry clamp
    ``notes``, and once per planner by :meth:`CanaryPlanner.verify_overflowed` on the first step
    whose verify was skipped; by a free :func:`plan` whose verify entries overflowed its
    ``verify_capacity``, once per output record: on host memory at the call, on a GPU at the next
    free plan into the same record (read from a copy queued without a sync;
    ``WritePlan.verify_entries_needed()`` says how many entries it asked for).  Turn it into an error with
    ``warnings.simplefilter("error", kc.CanaryCapacityWarning)``.
    """
