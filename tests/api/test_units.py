"""The one Kubernetes quantity parser: what users write in a FineTuneJob, and what the API server
reports for Nodes and pods, read exactly the way Kubernetes reads it."""
from __future__ import annotations

import re
from fractions import Fraction

import pytest

from memstrata.api.units import QUANTITY_PATTERN, parse_bytes, parse_quantity, quantity_value
from memstrata.operator.nodes import node_view, pod_requests

EXACT = [
    ("0", 0), ("4", 4), ("+4", 4), ("-4", -4),
    ("1k", 1000), ("1M", 10**6), ("3.84T", 384 * 10**10), ("1P", 10**15), ("2E", 2 * 10**18),
    ("2Ki", 2048), ("1.5Gi", 3 << 29), ("1Ti", 1 << 40), ("1Pi", 1 << 50), ("1Ei", 1 << 60),
    ("1e3", 1000), ("1E3", 1000), ("12e+2", 1200), (".5e1", 5), ("5.", 5),
    ("500m", Fraction(1, 2)), ("1500m", Fraction(3, 2)), ("250u", Fraction(1, 4000)), ("7n", Fraction(7, 10**9)),
    ("1e-3", Fraction(1, 1000)), ("0.1", Fraction(1, 10)),
    (1073741824, 1 << 30),
]


@pytest.mark.parametrize("text, value", EXACT)
def test_every_form_kubernetes_accepts_is_read_exactly(text: str | int, value: Fraction | int) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "lots", "1.2.3", "1 Gi", "1gi", "1K", "1ki", "1Gib", "Gi", "1e", "e3", "1e3Gi",
                                  "--1", "1Gi\n", "0x10"])
def test_what_kubernetes_refuses_is_refused_naming_the_value(text: str) -> None:
    with pytest.raises(ValueError, match=rf"not a Kubernetes quantity: {re.escape(repr(text))} \(expected a number"):
        parse_quantity(text)


@pytest.mark.parametrize("text, value", [
    ("4", 4), ("0", 0), ("1k", 1000), ("2Ki", 2048), ("1.5G", 1_500_000_000), ("1e2", 100), (3, 3),
    ("500m", 1), ("1001m", 2), ("2000m", 2),  # Quantity.Value(): rounded up
])
def test_node_and_pod_amounts_are_kubernetes_values(text: str | int, value: int) -> None:
    assert quantity_value(text) == value


def test_a_negative_node_or_pod_amount_is_an_error() -> None:
    with pytest.raises(ValueError, match="quantity must not be negative, got '-1'"):
        quantity_value("-1")


@pytest.mark.parametrize("given, value", [
    (0, 0), (1 << 30, 1 << 30), (1e9, 10**9), ("512Gi", 512 << 30), ("3.84T", 384 * 10**10), ("1e9", 10**9),
    ("+1Ki", 1024), ("0.5Ki", 512), ("1.5", 2), ("1e-1", 1),  # a fraction of a byte rounds up, as Value() does
])
def test_byte_counts(given: object, value: int) -> None:
    assert parse_bytes(given) == value


@pytest.mark.parametrize("given, message", [
    ("512m", r"'512m' is a fraction of a byte: 'm' is a sub-unit \(m = 1/1000\); for mebibytes write Mi"),
    ("3u", r"'3u' is a fraction of a byte"),
    ("-1Gi", r"byte quantity must not be negative, got '-1Gi'"),
    (-1, r"byte quantity must not be negative, got -1"),
    ("lots", r"expected a byte quantity like 512Gi or 3.84T, got 'lots'"),
    (1.5, r"expected a byte quantity like 512Gi or 3.84T, got 1.5"),
    (True, r"expected a byte quantity, got True"),
    (None, r"expected a byte quantity like 512Gi or 3.84T, got None"),
])
def test_byte_counts_refused_with_the_reason(given: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_bytes(given)


@pytest.mark.parametrize("text", [t for t, _ in EXACT if isinstance(t, str)] + ["1 Gi", "1gi", "1e3Gi", "lots"])
def test_the_crd_pattern_admits_exactly_what_parse_bytes_takes(text: str) -> None:
    try:
        parse_bytes(text)
        accepted = True
    except ValueError:
        accepted = False
    assert bool(re.fullmatch(QUANTITY_PATTERN, text)) == accepted, text


def test_node_allocatable_and_pod_requests_use_the_same_parser() -> None:
    node = {"metadata": {"name": "n1"}, "spec": {},
            "status": {"allocatable": {"memstrata.dev/nvme-ns": "4", "memstrata.dev/cxl-gib": "1e2",
                                       "nvidia.com/gpu": "2000m"},
                       "conditions": [{"type": "Ready", "status": "True"}]}}
    view = node_view(node)
    assert (view.allocatable["memstrata.dev/nvme-ns"], view.allocatable["memstrata.dev/cxl-gib"],
            view.allocatable["nvidia.com/gpu"]) == (4, 100, 2)
    requests = pod_requests({"containers": [{"resources": {"limits": {"memstrata.dev/cxl-gib": "3e1"}}}]})
    assert requests["memstrata.dev/cxl-gib"] == 30
