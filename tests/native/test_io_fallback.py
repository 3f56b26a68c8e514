"""The NVMe engine where the kernel refuses io_uring, as it does in a pod: a real seccomp filter on
a child process, a real loop device, the pod's uid, group and memlock limit; and the thread path
that takes over, forced, on files and loop devices."""
from __future__ import annotations

import errno
import json
import mmap
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from native_helpers import child_env, unavailable
from seccomp_helpers import IO_URING_REGISTER, IO_URING_SETUP, preexec, seccomp_unsupported

from memstrata.api.podidentity import DISK_GID, RUNTIME_UID
from memstrata.runtime import _native
from memstrata.runtime.strata import iobackend
from memstrata.runtime.strata.nvme import NvmeEngine

MiB = 1 << 20
DATA = random.Random(12).randbytes(3 * MiB + 4321)  # striped, unaligned tail: bounce region included


def on_device(path: str, offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)  # no O_EXCL: the engine may still hold the device
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


def _completions(queue_type: type, path: Path) -> list[tuple[int, int]]:
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        q = queue_type(4, [fd])
        buf, out = mmap.mmap(-1, 8192), mmap.mmap(-1, 4096)
        buf[:4096] = b"m" * 4096
        assert q.submit(True, 0, memoryview(buf)[:4096], 4096, 1) is False  # never a fixed buffer here
        q.submit(True, 0, memoryview(buf)[1:1001], 0, 2)  # misaligned for O_DIRECT
        first = sorted(q.wait(-1))
        assert q.wait(0) == [] and q.queued == 0
        q.submit(False, 0, out, 4096, 3)
        q.submit(False, 0, out, MiB, 4)  # at the end of the file: a 0-byte read, the façade's short read
        second = sorted(q.wait(2))
        assert out[:4096] == buf[:4096]
        for tag in range(5, 12):  # queued and never waited for: close drops or finishes them, never leaks
            q.submit(False, 0, out, 0, tag)
        q.close()
        q.close()
        with pytest.raises(ValueError, match="closed"):
            q.wait()
        return first + second
    finally:
        os.close(fd)


def test_thread_queue_completes_exactly_as_the_ring_does(tmp_path: Path) -> None:
    path = tmp_path / "q.img"
    with open(path, "wb") as f:
        f.truncate(MiB)
    want = [(1, 4096), (2, -errno.EINVAL), (3, 4096), (4, 0)]
    assert _completions(_native.Ring, path) == want
    assert _completions(_native.Threads, path) == want


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_forced_thread_path_round_trips_striped_and_queued_io(devices, how: str, monkeypatch) -> None:
    paths = devices(2, 32 * MiB)
    kwargs = {"io_backend": "threads"} if how == "argument" else {}
    if how == "environment":
        monkeypatch.setenv("MEMSTRATA_IO_BACKEND", "threads")
    with NvmeEngine.open(paths, job="t/threads", queue_depth=2, stripe_bytes=256 * 1024, max_io_bytes=64 * 1024,
                         **kwargs) as eng:
        assert (eng.io_backend, eng.io_fallback) == ("threads", None)  # asked for: no refusal to report
        blobs = [random.Random(i).randbytes(300_000 + i) for i in range(10)] + [DATA]
        exts = [eng.allocate(len(b)) for b in blobs]
        for shift in (0, 1):  # 1: an unaligned source, through a bounce region
            handles = [eng.write(e, memoryview(bytes(shift) + b)[shift:]) for e, b in zip(exts, blobs)]
            eng.wait_all()  # far more ops than the two worker threads: they queue
            assert all(h.done and h.error is None for h in handles)
            outs = [bytearray(len(b)) for b in blobs]
            for h in [eng.read(e, o) for e, o in zip(exts, outs)]:
                eng.wait(h)
            assert outs == [bytearray(b) for b in blobs]
        assert all(s.bytes_written > 0 and s.errors == 0 and s.fixed_buffer_ios == 0 for s in eng.stats())
        # What the threads wrote is on the devices, in stripe order (read past the engine, not through it).
        first, stripe = exts[0], 256 * 1024
        assert on_device(paths[first.slots[0]], first.bases[0], stripe) == blobs[0][:stripe]
        assert on_device(paths[first.slots[1]], first.bases[1], len(blobs[0]) - stripe) == blobs[0][stripe:]


def test_a_misspelt_backend_is_refused_before_any_device_is_claimed(tmp_path: Path, monkeypatch) -> None:
    p = tmp_path / "d.img"
    with open(p, "wb") as f:
        f.truncate(8 * MiB)
    monkeypatch.setenv("MEMSTRATA_IO_BACKEND", "uring")
    with pytest.raises(ValueError, match=r"\$MEMSTRATA_IO_BACKEND='uring': expected one of auto, io_uring, threads"):
        NvmeEngine.open([str(p)], job="t/typo")
    with pytest.raises(ValueError, match=r"io_backend='aio'"):
        NvmeEngine.open([str(p)], job="t/typo", io_backend="aio")
    monkeypatch.delenv("MEMSTRATA_IO_BACKEND")
    NvmeEngine.open([str(p)], job="t/typo", busy_timeout_s=0).close()  # nothing was left claimed


# -- the kernel's refusal, for real ------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import json, os, random, sys
    from memstrata.runtime import _native
    from memstrata.runtime.strata.errors import NvmeError
    from memstrata.runtime.strata.nvme import NvmeEngine
    dev, data = sys.argv[1], random.Random(12).randbytes(3 * (1 << 20) + 4321)
    null = os.open("/dev/null", os.O_RDWR)
    try:
        _native.Ring(4, [null]).close()
        probe = 0
    except OSError as e:
        probe = e.errno  # what the kernel answers this process, io_uring asked directly
    result = {"probe": probe}
    try:
        for attempt in range(2):  # a second engine: the warning is not repeated
            with NvmeEngine.open([dev], job="t/refused", queue_depth=8, stripe_bytes=1 << 20) as eng:
                ext = eng.allocate(len(data))
                eng.wait(eng.write(ext, data))
                out = bytearray(len(data))
                eng.wait(eng.read(ext, out))
                fd = os.open(dev, os.O_RDONLY)  # past the engine: the bytes really are on the device
                ondisk = os.pread(fd, len(data), ext.bases[0])
                os.close(fd)
                result.update(backend=eng.io_backend, fallback=eng.io_fallback, same=out == data == ondisk,
                              written=eng.stats()[0].bytes_written)
    except NvmeError as e:
        result["error"] = str(e)
    print(json.dumps(result))
""")


def _need_refusal_setup() -> None:
    why = seccomp_unsupported()
    if why:
        unavailable(why)


def _run(dev: str, pre: Callable[[], None], env: dict[str, str] | None = None) -> tuple[dict, str]:
    environ = {k: v for k, v in child_env().items() if k != "MEMSTRATA_IO_BACKEND"}
    proc = subprocess.run([sys.executable, "-c", CHILD, dev], capture_output=True, text=True, timeout=120,
                          env={**environ, **(env or {})}, preexec_fn=pre)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


@pytest.mark.loopdev
@pytest.mark.parametrize(("nr", "err", "call", "cause"), [
    (IO_URING_SETUP, errno.EPERM, "io_uring_queue_init", "seccomp profile"),  # containerd 2.x, Docker 25+
    (IO_URING_SETUP, errno.ENOSYS, "io_uring_queue_init", "no io_uring"),  # podman, kernels without it
    (IO_URING_REGISTER, errno.EPERM, "io_uring_register_files", "seccomp profile"),  # setup allowed, register not
], ids=["setup-EPERM", "setup-ENOSYS", "register-EPERM"])
def test_refused_io_uring_falls_back_to_threads_with_one_warning_and_correct_data(
        loopdev, nr: int, err: int, call: str, cause: str) -> None:
    _need_refusal_setup()
    dev = loopdev(64 * MiB)
    result, stderr = _run(dev, preexec(deny=[nr], err=err))
    name = errno.errorcode[err]
    assert result["probe"] == (err if nr == IO_URING_SETUP else errno.EPERM), result  # the filter really bites
    assert result["backend"] == "threads" and result["same"] is True and result["written"] >= len(DATA), result
    assert result["fallback"].startswith(f"io_uring refused by the kernel ({call}: {name}: ") and cause in \
        result["fallback"], result
    warnings = [line for line in stderr.splitlines() if "io_uring refused" in line]
    assert warnings == [f"memstrata: {result['fallback']}; using the pread/pwrite thread path (O_DIRECT, 8 threads) "
                        "for the NVMe stratum"], stderr


@pytest.mark.loopdev
def test_io_uring_asked_for_by_name_is_an_error_when_refused_not_a_silent_fallback(loopdev) -> None:
    _need_refusal_setup()
    dev = loopdev(16 * MiB)
    result, stderr = _run(dev, preexec(deny=[IO_URING_SETUP], err=errno.EPERM), {"MEMSTRATA_IO_BACKEND": "io_uring"})
    assert result["error"] == (f"{dev}: cannot set up io_uring (MEMSTRATA_IO_BACKEND=io_uring allows no fallback): "
                               "io_uring refused by the kernel (io_uring_queue_init: EPERM: the container's seccomp "
                               "profile (containerd's and Docker's RuntimeDefault deny io_uring) or sysctl "
                               "kernel.io_uring_disabled) [EPERM: Operation not permitted]"), result
    assert "thread path" not in stderr
    NvmeEngine.open([dev], job="t/after", busy_timeout_s=5).close()  # the refused open released the device


POD_CHILD = textwrap.dedent("""
    import json, os, random, sys
    from memstrata.runtime.strata.nvme import NvmeEngine
    from memstrata.runtime.strata.pinned import LockedPool, PinnedMemoryError
    dev, gid, uid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # Become the pod's process: runAsUser/runAsGroup 1000, supplementalGroups from the rendered pod,
    # and (setuid away from root) no capability left. Everything is imported already.
    os.setgroups([gid] if gid >= 0 else [])
    os.setgid(uid)
    os.setuid(uid)
    result = {"caps": open("/proc/self/status").read().split("CapEff:")[1].split()[0]}
    try:
        strict = LockedPool(32 << 20)
        try:
            strict.take(1)
            result["strict"] = "locked"
        except PinnedMemoryError as e:
            result["strict"] = e.errno
        pool = LockedPool(32 << 20, lock_fallback=True)  # the swap layer's default in a pod
        buf = pool.take(3 * (1 << 20) + 4321)
        buf[:] = random.Random(12).randbytes(len(buf))
        result["unlocked"] = pool.unlocked_reason
        with NvmeEngine.open([dev], job="t/pod") as eng:
            result["registered"] = eng.register_buffers([buf])
            ext = eng.allocate(len(buf))
            eng.wait(eng.write(ext, buf))
            out = bytearray(len(buf))
            eng.wait(eng.read(ext, out))
            result.update(backend=eng.io_backend, same=out == bytes(buf))
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(result))
""")


def _as_pod(dev: str, gid: int) -> tuple[dict, str]:
    pre = preexec(deny=[IO_URING_SETUP], err=errno.EPERM, memlock=8 * MiB)
    environ = {k: v for k, v in child_env().items() if k != "MEMSTRATA_IO_BACKEND"}
    proc = subprocess.run([sys.executable, "-c", POD_CHILD, dev, str(gid), str(RUNTIME_UID)], capture_output=True,
                          text=True, timeout=120, env=environ, preexec_fn=pre)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


@pytest.mark.loopdev
def test_the_rendered_pods_process_uses_its_namespace_on_a_node_like_this_one(loopdev) -> None:
    """uid 1000 with the pod's supplemental group, no capabilities, RuntimeDefault-like seccomp (io_uring
    refused) and the runtime's 8 MiB memlock limit: the namespace opens, the pool goes on unlocked, the
    engine on threads, and the bytes are right; without the group the device cannot even be opened."""
    _need_refusal_setup()
    dev = loopdev(64 * MiB)
    os.chown(dev, 0, DISK_GID)  # what udev does on a node: block devices are root:disk 0660
    os.chmod(dev, 0o660)
    result, stderr = _as_pod(dev, DISK_GID)
    assert "error" not in result, result
    assert int(result["caps"], 16) == 0 and result["strict"] in (errno.ENOMEM, errno.EPERM), result
    assert "RLIMIT_MEMLOCK is 8388608 bytes" in result["unlocked"], result
    assert result["backend"] == "threads" and result["same"] is True and result["registered"] is True, result
    assert sum("going on with unlocked host buffers" in line for line in stderr.splitlines()) == 1, stderr
    assert sum("using the pread/pwrite thread path" in line for line in stderr.splitlines()) == 1, stderr
    without, _ = _as_pod(dev, -1)
    assert "Permission denied" in without.get("error", ""), without


@pytest.mark.loopdev
def test_fixed_buffers_over_the_memlock_limit_warn_and_io_goes_on(loopdev) -> None:
    """io_uring allowed, but registered buffers count against RLIMIT_MEMLOCK without CAP_IPC_LOCK."""
    dev = loopdev(16 * MiB)
    code = textwrap.dedent("""
        import json, random, sys
        from memstrata.runtime import _native
        from memstrata.runtime.strata.nvme import NvmeEngine
        arena = _native.Region(4 << 20)
        view = memoryview(arena)
        view[:] = random.Random(5).randbytes(4 << 20)
        with NvmeEngine.open([sys.argv[1]], job="t/fixed") as eng:
            registered = eng.register_buffers([arena])
            ext = eng.allocate(4 << 20)
            eng.wait(eng.write(ext, view))
            out = bytearray(4 << 20)
            eng.wait(eng.read(ext, out))
            print(json.dumps({"registered": registered, "backend": eng.io_backend, "same": out == bytes(view),
                              "fixed": eng.stats()[0].fixed_buffer_ios}))
    """)
    proc = subprocess.run([sys.executable, "-c", code, dev], capture_output=True, text=True, timeout=120,
                          env=child_env(), preexec_fn=preexec(memlock=MiB, drop_ipc_lock=True))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result == {"registered": False, "backend": "io_uring", "same": True, "fixed": 0}, result
    assert "memstrata: io_uring cannot register fixed buffers (ENOMEM: registered buffers count against " \
           f"RLIMIT_MEMLOCK without CAP_IPC_LOCK; first on {dev}); I/O goes on with per-op page pinning" in proc.stderr


def test_refusal_causes_name_the_call_the_errno_and_what_to_change() -> None:
    def cause(code: int, call: str = "io_uring_queue_init") -> str:
        return iobackend.refusal_cause(OSError(code, f"{call}: {os.strerror(code)}"))

    assert cause(errno.EPERM).startswith("io_uring refused by the kernel (io_uring_queue_init: EPERM: the "
                                         "container's seccomp profile")
    assert "kernel.io_uring_disabled" in cause(errno.EPERM)
    assert "no io_uring" in cause(errno.ENOSYS) and "SELinux" in cause(errno.EACCES)
    assert "RLIMIT_MEMLOCK" in cause(errno.ENOMEM, "io_uring_register_files")
    assert cause(errno.EMFILE) == "io_uring setup failed (io_uring_queue_init: EMFILE, Too many open files)"


@pytest.mark.slow
def test_a_fine_tune_runs_to_the_end_where_io_uring_and_memory_locking_are_refused(tmp_path: Path) -> None:
    """`memstrata run` of the tiny example under a pod's limits: RuntimeDefault-like seccomp, the 8 MiB
    memlock limit, no CAP_IPC_LOCK. One warning for each, and the loss still falls."""
    _need_refusal_setup()
    job = tmp_path / "tiny.yaml"
    job.write_text((Path(__file__).resolve().parents[2] / "examples" / "finetune-tiny.yaml").read_text()
                   .replace("steps: 100", "steps: 4"))
    environ = {k: v for k, v in child_env().items() if k != "MEMSTRATA_IO_BACKEND"}
    proc = subprocess.run([sys.executable, "-m", "memstrata.cli", "run", str(job), "--nvme-path",
                           str(tmp_path / "scratch")], capture_output=True, text=True, timeout=900, env=environ,
                          preexec_fn=preexec(deny=[IO_URING_SETUP], err=errno.EPERM, memlock=8 * MiB,
                                             drop_ipc_lock=True))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert sum("using the pread/pwrite thread path" in line for line in lines) == 1, proc.stderr[-3000:]
    assert sum("going on with unlocked host buffers" in line for line in lines) == 1, proc.stderr[-3000:]
    losses = [float(line.split("loss ")[1].split()[0]) for line in lines if line.startswith("step ")]
    assert len(losses) == 4 and losses[-1] < losses[0], lines
