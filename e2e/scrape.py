"""Scraping a running service's /metrics as Prometheus does, parsed with prometheus-client's own parser."""
from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Samples:
    """One scrape: every sample, by name and labels."""

    text: str
    samples: tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]

    def value(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels` (0 when none has been recorded)."""
        want = set(labels.items())
        return sum(v for n, ls, v in self.samples if n == name and want <= set(ls))

    def has(self, name: str, **labels: str) -> bool:
        want = set(labels.items())
        return any(n == name and want <= set(ls) for n, ls, _ in self.samples)

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        """`name`'s samples: (labels, value) each."""
        return [(dict(ls), v) for n, ls, v in self.samples if n == name]


def scrape(url: str, timeout: float = 10) -> Samples:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        assert resp.headers.get_content_type() == "text/plain", resp.headers.get("Content-Type")
        text = resp.read().decode()
    return parse(text)


def parse(text: str) -> Samples:
    samples = tuple((s.name, tuple(sorted(s.labels.items())), float(s.value))
                    for family in text_string_to_metric_families(text) for s in family.samples)
    return Samples(text, samples)
