"""How `memstrata run` ends when it does not end well: SIGTERM is an orderly stop, what a killed run left is removed
by the next one (never what a live one holds), and a cleanup that fails after an error keeps that error the result.

Each test runs the real CLI on the tiny example and acts on it from outside, after it printed a training step."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "native"))  # the loop-device helpers
from native_helpers import _loop_unavailable, attach_loop, unavailable  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "finetune-tiny.yaml"
# Owns each directory named on its command line (made after its owner file, as a run makes its own), then waits.
HOLDER = ("import pathlib, sys, time\nfrom memstrata.runtime.train.model.owner import own\nheld = []\n"
          "for name in sys.argv[1:]:\n    held.append(own(pathlib.Path(name)))\n    pathlib.Path(name).mkdir()\n"
          "    (pathlib.Path(name) / 'state').write_bytes(b'x' * 4096)\nprint('held', flush=True)\ntime.sleep(600)\n")
# `memstrata run` in this process, then which of its threads and files are still open.
IN_PROCESS = ("import json, os, sys, threading\nfrom memstrata.cli import main\nrc = main(sys.argv[1:])\n"
              "fds = [str(p.resolve()) for p in __import__('pathlib').Path('/proc/self/fd').iterdir()]\n"
              "print(json.dumps({'rc': rc, 'threads': [t.name for t in threading.enumerate()], 'fds': fds}))\n")


def _job(tmp: Path, output: Path, steps: int = 200) -> Path:
    doc = yaml.safe_load(TINY.read_text())
    doc["spec"]["training"]["steps"] = steps
    doc["spec"]["output"] = {"path": str(output)}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


class _Run:
    """A child process whose output (stdout and stderr) is collected line by line as it comes."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout or []), daemon=True)
        self._reader.start()

    def wait_for(self, text: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, f"no {text!r}:\n{self.output[-3000:]}"
            time.sleep(0.05)

    def end(self, timeout: float = 120) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return rc

    @property
    def output(self) -> str:
        return "".join(self.lines)


def _names(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()} if path.exists() else set()


def test_sigterm_stops_in_order_and_a_killed_runs_leftovers_are_reclaimed(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: run `make install`")
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    job = _job(tmp_path, out)
    # A run SIGKILLed mid-step: its scratch directory (swap files and all) stays behind.
    killed = _Run("-m", "memstrata.cli", "run", str(job), "--nvme-path", str(scratch))
    killed.wait_for("step 2/200")
    killed.proc.kill()
    assert killed.end() == -signal.SIGKILL
    left = {n for n in _names(scratch) if not n.endswith(".owner")}
    assert len(left) == 1 and sum(f.stat().st_size for n in left for f in (scratch / n).rglob("*") if f.is_file())
    # A partial output of a process killed while saving, and a live process's scratch directory and partial output.
    dead = _Run("-c", HOLDER, str(tmp_path / ".out.partial-dead"),
                str(tmp_path / "..out.best-step-00000004.partial-dead"))  # a best model's export, keepBest
    dead.wait_for("held")
    dead.proc.kill()
    dead.end()
    live = _Run("-c", HOLDER, str(scratch / "memstrata-run-live-1-1"), str(tmp_path / ".out.partial-live"))
    live.wait_for("held")
    try:
        run = _Run("-m", "memstrata.cli", "run", str(job), "--nvme-path", str(scratch))
        run.wait_for("step 2/200")
        for name in left:
            assert f"removed {scratch / name}, left by a run that was killed" in run.output, run.output[-3000:]
        assert not (tmp_path / ".out.partial-dead").exists() and not (tmp_path / ".out.partial-dead.owner").exists()
        assert not (tmp_path / "..out.best-step-00000004.partial-dead").exists()
        assert f"removed {tmp_path / '..out.best-step-00000004.partial-dead'}, left by a run" in run.output
        assert (scratch / "memstrata-run-live-1-1" / "state").exists()
        assert (tmp_path / ".out.partial-live" / "state").exists()
        run.proc.send_signal(signal.SIGTERM)  # mid-run: it printed step 2 of 200
        rc = run.end()
        assert rc == 128 + signal.SIGTERM, f"exit {rc}\n{run.output[-3000:]}"
        assert "Traceback" not in run.output and "step 200/200" not in run.output, run.output[-3000:]
        assert run.output.rstrip().splitlines()[-1] == (
            "memstrata: finetune-tiny: stopped by SIGTERM; its scratch files are removed")
        assert _names(scratch) == {"memstrata-run-live-1-1", "memstrata-run-live-1-1.owner"}
        # Its metrics stay (every step it finished is in them); no output, whole or partial.
        assert _names(tmp_path) == {"job.yaml", "scratch", "out-metrics", ".out.partial-live",
                                    ".out.partial-live.owner"}
    finally:
        live.proc.kill()
        live.end()


@pytest.mark.loopdev
def test_a_cleanup_failure_after_an_error_keeps_that_error_the_result(tmp_path: Path) -> None:
    """The run's NVMe namespace (a loop device) vanishes mid-run: every read and write gets EIO, so training fails,
    and so does closing the namespace after it. The first error stays the result; the memory watch still stops
    and the metrics still close."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: run `make install`")
    why = _loop_unavailable()
    if why:
        unavailable(why)
    image = tmp_path / "ns.img"
    image.write_bytes(b"")
    os.truncate(image, 512 << 20)
    dev = attach_loop(image, "--direct-io=on")
    try:
        out = tmp_path / "out"
        run = _Run("-c", IN_PROCESS, "run", str(_job(tmp_path, out)), "--nvme-path", str(tmp_path / "scratch"),
                   env={"MEMSTRATA_NVME_DEVICES": dev})
        run.wait_for("step 2/200")
        os.truncate(image, 0)  # the namespace goes: the loop device shrinks to nothing
        subprocess.run(["losetup", "-c", dev], check=True, capture_output=True)
        assert run.end(timeout=300) == 0, run.output[-3000:]
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True, timeout=60)
    said = [line for line in run.lines if line.startswith("memstrata: ") and "initializing" not in line
            and "training on" not in line]
    assert "Traceback" not in run.output, run.output[-3000:]
    assert said[0].startswith(f"memstrata: run failed: NvmeError: {dev} ") and "EIO" in said[0], said
    assert len(said) == 2 and said[1].startswith("memstrata: cleanup failed: removing the swap layer"), said
    state = json.loads(run.lines[-1])
    assert state["rc"] == 1, state
    assert "memstrata-memwatch" not in state["threads"], state
    assert not [fd for fd in state["fds"] if fd.startswith(str(out))], state  # metrics.jsonl, TensorBoard's events
