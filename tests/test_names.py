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
