"""Where a service listens: one rule for the operator's and the node agent's `--metrics-bind-address`.

Pure: text in, (host, port) out, or a ValueError that names what is wrong.
"""
from __future__ import annotations

METRICS_PORT = 9090  # the chart's default for both services; Prometheus' own convention for an exporter


def parse_bind_address(text: str) -> tuple[str, int] | None:
    """`HOST:PORT`, `:PORT` (every address) or `0` (off, as controller-runtime reads it): the address to bind,
    or None when metrics are off. `[::1]:9090` for IPv6."""
    text = text.strip()
    if text in ("", "0"):
        return None
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ValueError(f"{text!r}: not HOST:PORT (e.g. :{METRICS_PORT} or 127.0.0.1:{METRICS_PORT}); 0 turns it off")
    host = host.removeprefix("[").removesuffix("]") or "0.0.0.0"
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{text!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"{text!r}: port {port} is outside 1-65535")
    return host, port
