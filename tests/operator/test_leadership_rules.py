"""The Lease rules (memstrata.operator.leadership.claim): who may write the Lease, and when."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from memstrata.operator.leadership import LeaseTiming, claim
from memstrata.operator.main import build_parser, config_from_args

NOW = datetime(2026, 11, 23, 10, 0, 0, 123456, tzinfo=timezone.utc)
T = LeaseTiming(lease_seconds=15, renew_deadline_seconds=10, retry_seconds=2)
HELD = {"holderIdentity": "a", "leaseDurationSeconds": 15, "acquireTime": "2026-11-23T09:00:00.000000Z",
        "renewTime": "2026-11-23T09:59:59.000000Z", "leaseTransitions": 3}


def test_an_empty_or_missing_lease_is_acquired() -> None:
    for spec in (None, {}, {**HELD, "holderIdentity": ""}):
        got = claim(spec, "b", 0.0, NOW, T)
        assert got is not None and got["holderIdentity"] == "b"
        assert got["acquireTime"] == got["renewTime"] == "2026-11-23T10:00:00.123456Z"


def test_another_holder_keeps_it_until_its_record_stood_still_for_its_own_duration() -> None:
    assert claim(HELD, "b", 14.9, NOW, T) is None
    # The holder's own leaseDurationSeconds counts, not the observer's setting.
    assert claim({**HELD, "leaseDurationSeconds": 60}, "b", 30.0, NOW, T) is None
    taken = claim(HELD, "b", 15.0, NOW, T)
    assert taken is not None and taken["holderIdentity"] == "b" and taken["leaseTransitions"] == 4


def test_the_holder_renews_keeping_its_acquire_time() -> None:
    got = claim(HELD, "a", 100.0, NOW, T)
    assert got is not None
    assert got["acquireTime"] == HELD["acquireTime"] and got["renewTime"] == "2026-11-23T10:00:00.123456Z"
    assert got["leaseTransitions"] == 3


@pytest.mark.parametrize("lease,renew,retry", [(10, 10, 2), (15, 10, 10), (15, 20, 2), (15, 10, 0)])
def test_timings_where_a_holder_could_act_after_a_takeover_are_refused(lease: float, renew: float,
                                                                       retry: float) -> None:
    with pytest.raises(ValueError, match="renew deadline"):
        LeaseTiming(lease, renew, retry)
    args = build_parser().parse_args(["--lease-duration-seconds", str(lease), "--renew-deadline-seconds", str(renew),
                                      "--retry-period-seconds", str(retry)])
    with pytest.raises(SystemExit, match="--lease-duration-seconds"):
        config_from_args(args)


def test_each_process_gets_its_own_identity() -> None:
    a = config_from_args(build_parser().parse_args([]))
    b = config_from_args(build_parser().parse_args([]))
    assert a.identity != b.identity and a.lease == "memstrata-operator"
    assert config_from_args(build_parser().parse_args(["--standalone"])).lease is None

