"""One name per concept (issue #29 item 10): the canonical keyword works, the older spelling keeps working."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from canary_builders import ANCHOR_H, canary, make_log, make_verify_plan
from conftest import get_backend_or_skip


def _token_case(ab):
    """Slot 5 holds token 33 at position 0 (a valid chain head) where token 34 is expected."""
    return ab.asarray(canary(16, {5: (33, 0, ANCHOR_H)})), make_verify_plan(ab, [5], [0], [-1], tokens=[34])


def _log_bytes(ab, log):
    return [ab.to_numpy(a).tobytes() for a in log.arrays().values()]


@pytest.mark.parametrize("how", ["free", "launcher"])
def test_check_expected_tokens_and_its_alias_check_the_same(ab, how):
    logs = {}
    for spelling in ("check_expected_tokens", "check_expected_token", None):
        buf, vp = _token_case(ab)
        log = make_log(ab)
        flag = {} if spelling is None else {spelling: True}
        if how == "free":
            kc.verify(buf, vp, log=log, **flag)
        else:
            kc.VerifyLauncher(buf, vp, log=log, **flag)()
        logs[spelling] = _log_bytes(ab, log)
    assert logs["check_expected_tokens"] == logs["check_expected_token"] != logs[None]
    buf, vp = _token_case(ab)
    log = make_log(ab)
    kc.verify(buf, vp, log=log, check_expected_tokens=True)
    (v,) = log.read().violations
    assert (v.slot_idx, v.stored_token, v.expected_token, v.reasons) == (5, 33, 34, "verify_token")


def test_plan_and_verify_takes_check_expected_tokens(ab):
    rtt = np.zeros((2, 4), np.int32)
    rtt[1] = [5, 6, 7, 8]
    pool = np.zeros((2, 4), np.int32)
    pool[1] = [34, 0, 0, 0]
    results = []
    for spelling in ("check_expected_tokens", "check_expected_token"):
        buf, _ = _token_case(ab)
        log = make_log(ab)
        kc.plan_and_verify(ab.asarray(np.array([1])), ab.asarray(np.array([1])), ab.asarray(np.array([0])),
                           ab.asarray(rtt), buf, log=log, verify_capacity=4,
                           req_to_verify_expected_tokens=ab.asarray(pool),
                           req_to_verify_expected_tokens_valid_lens=ab.asarray(np.array([1])), **{spelling: True})
        results.append(_log_bytes(ab, log))
        assert [v.reasons for v in log.read().violations] == ["verify_token"]
    assert results[0] == results[1]


def test_the_alias_and_the_name_must_agree():
    buf, vp = _token_case(get_backend_or_skip("numpy"))
    log = kc.ViolationLog.allocate(4)
    with pytest.raises(ValueError, match="check_expected_tokens=True and its alias check_expected_token=False disagree; "
                                         "pass check_expected_tokens only"):
        kc.verify(buf, vp, log=log, check_expected_tokens=True, check_expected_token=False)
    kc.verify(buf, vp, log=log, check_expected_tokens=True, check_expected_token=True)  # agreeing is fine
    with pytest.raises(TypeError, match="check_expected_tokens must be a bool, got int"):
        kc.verify(buf, vp, log=log, check_expected_tokens=1)
    with pytest.raises(TypeError, match="check_expected_token must be a bool, got int"):
        kc.VerifyLauncher(buf, vp, log=log, check_expected_token=1)
    with pytest.raises(TypeError, match="check_expected_tokens must be a bool, got str"):
        kc.VerifyLauncher(buf, vp, log=log, check_expected_tokens="yes")


def _session_expected_token_run(ab, **spelling):
    """Row 1 prefills tokens 5, 6, 7 at slots 16-18; the next step's expected pool says 9 at
    position 2, so its verify reports slot 18 under the given spelling of the pool's keywords."""
    limit = spelling.pop("init", {"max_batch_size": 2})
    session = kc.CanarySession(64, on_violation="ignore", check_expected_tokens=True, like=ab.like, **limit)
    rtt = ab.asarray(np.arange(64, dtype=np.int32).reshape(4, 16))
    a = lambda *x: ab.asarray(np.array(x, np.int64))  # noqa: E731
    pool = ab.asarray(np.array([[0] * 16, [5, 6, 9, 8] + [0] * 12, [0] * 16, [0] * 16], np.int32))
    for prefix, ids, pos, loc in ((0, (5, 6, 7), (0, 1, 2), (16, 17, 18)), (3, (8,), (3,), (19,))):
        keywords = {k: (pool if "valid" not in k else a(prefix)) for k in spelling["names"]}
        session.pre_forward(a(1), a(prefix), a(len(ids)), rtt, a(*ids), a(*pos), a(*loc), **keywords)
        session.post_forward()
        session.end_step()
    session.check()
    return [(v.slot_idx, v.stored_token, v.expected_token, v.reasons) for v in session.report().violations]


def test_session_takes_the_expected_token_pool_under_both_spellings(ab):
    new = _session_expected_token_run(ab, names=("req_to_verify_expected_tokens", "req_to_verify_expected_tokens_valid_lens"))
    old = _session_expected_token_run(ab, names=("expected_tokens", "expected_tokens_valid_lens"))
    assert new == old == [(18, 7, 9, "verify_token")] * 2  # the HEAD and the TAIL verify
    by_limit = _session_expected_token_run(ab, names=("expected_tokens", "expected_tokens_valid_lens"),
                                           init={"write_req_capacity": 2})
    assert by_limit == old


def test_session_refuses_two_spellings_that_disagree(ab):
    with pytest.raises(ValueError, match="max_batch_size=2 and write_req_capacity=3"):
        kc.CanarySession(64, max_batch_size=2, write_req_capacity=3, like=ab.like)
    with pytest.raises(TypeError, match="needs max_batch_size"):
        kc.CanarySession(64, like=ab.like)
    session = kc.CanarySession(64, write_req_capacity=2, like=ab.like)
    assert session.max_batch_size == 2
    one, two = (ab.asarray(np.zeros((4, 16), np.int32)) for _ in range(2))
    a = lambda *x: ab.asarray(np.array(x, np.int64))  # noqa: E731
    rtt = ab.asarray(np.arange(64, dtype=np.int32).reshape(4, 16))
    with pytest.raises(ValueError, match="expected_tokens and req_to_verify_expected_tokens are two spellings"):
        session.pre_forward(a(1), a(0), a(1), rtt, a(5), a(0), a(16), expected_tokens=one,
                            req_to_verify_expected_tokens=two)
