"""`memstrata operator` flags for the training pod: bad values are refused by name, good ones reach the config."""
from __future__ import annotations

import pytest

from memstrata.operator.main import build_parser, config_from_args


@pytest.mark.parametrize("flags,field", [
    (["--training-device-gid", "disk"], "device group 'disk'"),
    (["--training-device-gid", "0"], "device group 0"),
    (["--training-seccomp-profile", "Unconfined"], "seccomp profile 'Unconfined'"),
    (["--training-seccomp-profile", "localhost/../etc/x.json"], "seccomp profile"),
])
def test_bad_training_pod_flags_are_refused_by_name(flags: list[str], field: str) -> None:
    with pytest.raises(SystemExit, match="--training-device-gid/--training-seccomp-profile") as exc:
        config_from_args(build_parser().parse_args(flags))
    assert field in str(exc.value)


def test_training_pod_flags_reach_the_config() -> None:
    config = config_from_args(build_parser().parse_args(
        ["--training-device-gid", "none", "--training-seccomp-profile", "localhost/memstrata/io-uring.json"]))
    assert config.pod_security.device_gid is None
    assert config.pod_security.seccomp_profile == "localhost/memstrata/io-uring.json"
