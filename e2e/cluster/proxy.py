"""A TCP relay between one client and the API server, so a test can cut that client's connections
(its watches and any request in flight) without touching the server or any other client.

TLS passes through untouched: the client still verifies the API server's certificate (issued for
127.0.0.1, where the relay listens too) and authenticates with its own.
"""
from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path
from urllib.parse import urlparse

import yaml


class Relay:
    def __init__(self, upstream: str) -> None:
        url = urlparse(upstream)
        self._upstream = (url.hostname or "127.0.0.1", url.port or 443)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.server = f"https://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self.dropped = 0
        self._closed = False
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def kubeconfig(self, original: Path, path: Path) -> Path:
        """A copy of `original` that reaches the API server through this relay."""
        cfg = yaml.safe_load(original.read_text())
        for cluster in cfg["clusters"]:
            cluster["cluster"]["server"] = self.server
        path.write_text(yaml.safe_dump(cfg))
        return path

    def drop(self) -> int:
        """Reset every connection now open (as a load balancer or a node's conntrack flush would);
        returns how many client connections were cut."""
        with self._lock:
            conns, self._open = self._open, []
        for s in conns:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
                # shutdown first: a close alone would wait for the pump thread blocked in recv on it.
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        cut = len(conns) // 2
        self.dropped += cut
        return cut

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.drop()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_RDWR)  # the other pump sees EOF and closes its own end
            except OSError:
                pass
            src.close()
            with self._lock:
                self._open = [s for s in self._open if s not in (src, dst)]
