"""Boot the memstrata test guest under QEMU (TCG) and run one Python script in it.

The guest is a real Linux 6.12 with the node a user would have: two CPUs on
NUMA node 0, a memory-only node 1, a CXL Type-3 volatile memory expander that
e2e/node/guest-init.sh turns into a CPU-less NUMA node in a lower memory tier,
and one NVMe controller with four namespaces (1 free, 2 ext4, 3 GPT, 4 held by
device-mapper). Inside the guest the repository is /repo (read-only, on
PYTHONPATH as /repo/runtime and /repo/operator) and the script's output
directory is /out (also $MEMSTRATA_OUT); see guest-init.sh.

    result = run_in_guest("import os; print(os.listdir('/sys/bus/cxl/devices'))", timeout=120)
    result.check()            # raises GuestError unless the script exited 0
    result.stdout, result.files["x.json"]

The artifacts come from `make guest` (e2e/node/build/build-guest.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
QEMU = "qemu-system-x86_64"
ARTIFACTS = ("vmlinuz", "initrd.img", "rootfs.ext4")
# Sizes of the four namespaces' backing files (sparse; ns1 stays all zeroes).
NAMESPACE_MIB = (256, 64, 64, 64)
# quiet boot: no console chatter, no spectre mitigations (TCG is slow enough),
# sysrq for the init's power-off, and any panic ends QEMU (-no-reboot). lpj skips
# the delay-loop calibration (~1.5 s on TCG; only udelay precision depends on it);
# the jitter-entropy self-test and crypto self-tests cost ~1 s and guard nothing here.
KERNEL_CMDLINE = (
    "console=ttyS0,115200 quiet loglevel=1 panic=-1 oops=panic sysrq_always_enabled=1 "
    "mitigations=off random.trust_cpu=on no_timer_check nokaslr lpj=9999900 "
    "initcall_blacklist=jent_mod_init cryptomgr.notests "
    "i8042.noaux i8042.nokbd i8042.nopnp rdinit=/init"
)
_EXIT_MARK = re.compile(rb"MEMSTRATA_EXIT_STATUS=(\d+)")


class GuestError(RuntimeError):
    """The guest could not be booted, set up, or the script failed (message says which)."""


@dataclass(frozen=True)
class GuestResult:
    """What came back from one boot: the script's output, status and files."""

    stdout: str
    stderr: str
    exit_status: int | None
    """The script's exit status; None when the guest never reported one."""
    files: dict[str, bytes]
    """Files the script wrote under /out, keyed by path relative to /out."""
    out_dir: Path
    """Host directory that was /out (kept until the caller removes it)."""
    console: str
    init_log: str
    timings: dict[str, float] = field(default_factory=dict)
    """Guest uptime (s) at init's milestones: modules, cxl, nvme, script_start, script_end."""
    wall_seconds: float = 0.0
    timed_out: bool = False

    def check(self) -> "GuestResult":
        if self.exit_status != 0:
            raise GuestError(
                f"guest script exited {self.exit_status} (timed_out={self.timed_out})\n"
                f"--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-4000:]}\n"
                f"--- init.log ---\n{self.init_log[-2000:]}\n--- console ---\n{self.console[-2000:]}"
            )
        return self


def guest_dir() -> Path | None:
    """The built guest: $MEMSTRATA_GUEST_DIR (set by mk/guest.mk), else the newest cached build."""
    env = os.environ.get("MEMSTRATA_GUEST_DIR")
    if env:
        return Path(env)
    cache = Path(os.environ.get("CACHE", Path.home() / ".cache" / "memstrata"))
    built = sorted(cache.glob("guest-*/.complete"), key=lambda p: p.stat().st_mtime)
    return built[-1].parent if built else None


def missing_reason() -> str | None:
    """Why the guest cannot run here, or None when it can."""
    gdir = guest_dir()
    if gdir is None:
        return "no QEMU guest built: run `make guest` (MEMSTRATA_GUEST_DIR unset, no ~/.cache/memstrata/guest-*)"
    absent = [a for a in ARTIFACTS if not (gdir / a).is_file()]
    if absent or not (gdir / ".complete").exists():
        return f"QEMU guest in {gdir} is incomplete (missing {absent or ['.complete']}): run `make guest`"
    if shutil.which(QEMU) is None:
        return f"{QEMU} not installed: run `make guest` (installs QEMU 10 from bookworm-backports)"
    return None


def qemu_command(gdir: Path, work: Path, out_dir: Path, ctl: Path, extra_cmdline: str = "") -> list[str]:
    """The QEMU command line: q35 with CXL, two NUMA nodes, a CXL expander, NVMe x4, 9p shares."""
    cmd = [
        QEMU, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-machine", "q35,cxl=on", "-accel", "tcg", "-cpu", "max,hypervisor=off",
        "-smp", "2", "-m", "2G",
        "-object", "memory-backend-ram,id=m0,size=1536M",
        "-object", "memory-backend-ram,id=m1,size=512M",
        "-numa", "node,nodeid=0,cpus=0-1,memdev=m0",
        "-numa", "node,nodeid=1,memdev=m1",
        # CXL: host bridge -> root port -> Type-3 volatile expander, in a 4 GiB window.
        "-object", "memory-backend-ram,id=cxl-mem0,share=on,size=512M",
        "-device", "pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.1",
        "-device", "cxl-rp,port=0,bus=cxl.1,id=rp0,chassis=0,slot=2",
        "-device", "cxl-type3,bus=rp0,volatile-memdev=cxl-mem0,id=cxl-vmem0,sn=0x1234",
        "-M", "cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=4G",
        "-device", "nvme,id=nvme0,serial=deadbeef,bus=pcie.0",
    ]
    for nsid, mib in enumerate(NAMESPACE_MIB, start=1):
        backing = work / f"ns{nsid}.img"
        with open(backing, "wb") as f:
            f.truncate(mib << 20)
        cmd += ["-drive", f"if=none,id=ns{nsid},file={backing},format=raw,cache=unsafe",
                "-device", f"nvme-ns,drive=ns{nsid},nsid={nsid},bus=nvme0"]
    cmd += [
        # snapshot=on: the root image is shared by every boot and never changes.
        "-drive", f"if=none,id=root,file={gdir / 'rootfs.ext4'},format=raw,snapshot=on",
        "-device", "virtio-blk-pci,drive=root,bus=pcie.0",
    ]
    # -virtfs would plug into the last PCI bus (the CXL host bridge, which refuses it).
    for tag, path, ro in (("repo", REPO, True), ("out", out_dir, False), ("ctl", ctl, False)):
        cmd += ["-fsdev", f"local,id=fs-{tag},path={path},security_model=none" + (",readonly=on" if ro else ""),
                "-device", f"virtio-9p-pci,fsdev=fs-{tag},mount_tag={tag},bus=pcie.0"]
    cmd += [
        "-serial", f"file:{work / 'console.log'}", "-monitor", "none",
        "-kernel", str(gdir / "vmlinuz"), "-initrd", str(gdir / "initrd.img"),
        "-append", f"{KERNEL_CMDLINE} {extra_cmdline}".strip(),
    ]
    return cmd


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def _collect_files(out_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out_dir)): p.read_bytes() for p in sorted(out_dir.rglob("*")) if p.is_file()}


def _exit_status(ctl: Path, console: str) -> int | None:
    text = _read(ctl / "exit_status").strip()
    if text.isdigit():
        return int(text)
    marks = _EXIT_MARK.findall(console.encode())
    return int(marks[-1]) if marks else None


def _timings(ctl: Path) -> dict[str, float]:
    pairs = (line.split() for line in _read(ctl / "timings").splitlines())
    return {p[0]: float(p[1]) for p in pairs if len(p) == 2}


def run_in_guest(script: str, timeout: float = 180.0, out_dir: Path | None = None,
                 extra_cmdline: str = "") -> GuestResult:
    """Boot the guest, run `script` with python3 as root in it, power off, and return what it left.

    Raises GuestError when the guest is not built, QEMU fails to start, or the
    guest's own setup (CXL region, namespaces) fails — never a result that looks
    like the script ran. A script failure or timeout is a GuestResult; call check().
    `extra_cmdline` is appended to the kernel command line (e.g. "memstrata.trace"
    to trace guest-init.sh into the result's init_log).
    """
    reason = missing_reason()
    if reason:
        raise GuestError(reason)
    gdir = guest_dir()
    assert gdir is not None
    work = Path(tempfile.mkdtemp(prefix="memstrata-guest-"))
    own_out = out_dir is None
    out_dir = out_dir or Path(tempfile.mkdtemp(prefix="memstrata-guest-out-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    ctl = work / "ctl"
    ctl.mkdir()
    (ctl / "script.py").write_text(script)
    try:
        cmd = qemu_command(gdir, work, out_dir, ctl, extra_cmdline)
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        timed_out = False
        try:
            qemu_out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            qemu_out, _ = proc.communicate()
            timed_out = True
        wall = time.monotonic() - start
        console = _read(work / "console.log")
        if not timed_out and proc.returncode != 0:
            raise GuestError(f"QEMU exited {proc.returncode}: {qemu_out.decode(errors='replace')[-3000:]}"
                             f"\n--- console ---\n{console[-3000:]}")
        init_log = _read(ctl / "init.log")
        if (ctl / "setup_failed").exists():
            raise GuestError(f"guest setup failed: {_read(ctl / 'setup_failed').strip()}\n"
                             f"--- init.log ---\n{init_log[-4000:]}\n--- console ---\n{console[-2000:]}")
        return GuestResult(
            stdout=_read(ctl / "stdout"), stderr=_read(ctl / "stderr"),
            exit_status=_exit_status(ctl, console), files=_collect_files(out_dir), out_dir=out_dir,
            console=console, init_log=init_log, timings=_timings(ctl), wall_seconds=wall,
            timed_out=timed_out,
        )
    except BaseException:
        if own_out:  # nobody will ever see a temp /out from a boot that raised
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def json_from_guest(script: str, filename: str, timeout: float = 400.0) -> Any:
    """Run `script` in the guest and return the JSON it wrote to /out/`filename`; the
    output directory is removed. Raises GuestError like run_in_guest."""
    result = run_in_guest(script, timeout=timeout).check()
    try:
        return json.loads(result.files[filename])
    finally:
        shutil.rmtree(result.out_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """`python3 e2e/node/guest.py [--out DIR] FILE [ARGS...]`: run a repo file in the guest."""
    parser = argparse.ArgumentParser(description="Run a Python file of this repository inside the test guest.")
    parser.add_argument("--out", type=Path, help="host directory shared as /out (default: a new temp dir)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before QEMU is killed")
    parser.add_argument("--trace", action="store_true", help="trace guest-init.sh into init.log")
    parser.add_argument("file", type=Path, help="a .py file inside the repository (runs as /repo/...)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    try:
        in_guest = "/repo/" + str(args.file.resolve().relative_to(REPO))
    except ValueError:
        parser.error(f"{args.file} is not inside the repository {REPO}; the guest only sees /repo")
    wrapper = (f"import runpy, sys\nsys.argv = {[in_guest, *args.args]!r}\n"
               f"runpy.run_path({in_guest!r}, run_name='__main__')\n")
    result = run_in_guest(wrapper, args.timeout, args.out, "memstrata.trace" if args.trace else "")
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if args.trace:
        sys.stderr.write(result.init_log)
    print(f"guest: exit {result.exit_status}, wall {result.wall_seconds:.1f} s, "
          f"uptime {result.timings}, /out is {result.out_dir}", file=sys.stderr)
    return 124 if result.exit_status is None else result.exit_status


if __name__ == "__main__":
    raise SystemExit(main())
