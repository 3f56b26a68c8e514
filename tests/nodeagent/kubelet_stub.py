"""Drive e2e/kubelet (the kubelet's side of the device-plugin API, in Go) from a test.

    stub = KubeletStub(binary, plugin_dir).start()
    reg = stub.wait_for("register", resource="memstrata.dev/nvme-ns")
    devices = stub.wait_for("devices", resource=...)["devices"]
    stub.allocate("memstrata.dev/nvme-ns", ["..."])
    stub.restart()          # a kubelet restart: kubelet.sock re-created, plugin sockets wiped
    stub.stop()
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def stub_binary() -> tuple[Path | None, str]:
    """The built stub ($MEMSTRATA_KUBELET_STUB from mk/kubelet-stub.mk, else the newest cached one)."""
    env = os.environ.get("MEMSTRATA_KUBELET_STUB")
    if env:
        path = Path(env)
        return (path, "") if path.is_file() else (None, f"{path} (MEMSTRATA_KUBELET_STUB) not built: make kubelet-stub")
    cache = Path(os.environ.get("CACHE", Path.home() / ".cache" / "memstrata"))
    built = sorted(cache.glob("kubelet-stub-*/kubelet-stub"), key=lambda p: p.stat().st_mtime)
    if built:
        return built[-1], ""
    return None, f"no kubelet stub under {cache}/kubelet-stub-*: run `make kubelet-stub` (needs Go)"


class KubeletStub:
    def __init__(self, binary: Path, plugin_dir: Path) -> None:
        self.binary = binary
        self.plugin_dir = plugin_dir
        self.proc: subprocess.Popen[str] | None = None
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.backlog: list[dict[str, Any]] = []  # events no wait_for has returned yet
        self.stderr = ""

    def start(self) -> "KubeletStub":
        self.proc = subprocess.Popen([str(self.binary), "-dir", str(self.plugin_dir)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        threading.Thread(target=self._read, args=(self.proc, self.events), daemon=True).start()
        self.wait_for("ready")
        return self

    def _read(self, proc: subprocess.Popen[str], events: queue.Queue[dict[str, Any]]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            events.put(json.loads(line))
        assert proc.stderr is not None
        self.stderr += proc.stderr.read()

    def wait_for(self, event: str, timeout: float = 10.0, **match: Any) -> dict[str, Any]:
        """The oldest not yet returned event of this kind whose fields equal `match`."""
        def matches(e: dict[str, Any]) -> bool:
            return e["event"] == event and all(e.get(k) == v for k, v in match.items())

        for i, e in enumerate(self.backlog):
            if matches(e):
                return self.backlog.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {event} {match} from the kubelet stub within {timeout} s; "
                                   f"saw {[e['event'] for e in self.seen][-20:]}; stderr: {self.stderr[-2000:]}")
            try:
                got = self.events.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(got)
            if matches(got):
                return got
            self.backlog.append(got)

    def send(self, **command: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def allocate(self, resource: str, ids: list[str], timeout: float = 10.0) -> dict[str, Any]:
        self.send(op="allocate", resource=resource, ids=ids)
        return self.wait_for("allocate", timeout=timeout, resource=resource, ids=ids)

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            self.send(op="quit")
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """A kubelet restart: what the old process said is forgotten, as the kubelet forgets it."""
        self.stop()
        self.backlog.clear()
        self.events = queue.Queue()
        self.start()
