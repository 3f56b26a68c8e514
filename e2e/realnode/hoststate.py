"""What the real node changes on the host, and how it is put back: the harness must leave a CI machine
(or a developer's) as it found it, even after a run that was killed before its cleanup.

    why = foreign_node_reason()          # a node that is not ours lives here: touch nothing
    saved = HostSettings(path).save()    # sysctls the kubelet rewrites; restored by restore()
    loops = LoopFiles(dir).make(2, 2 << 30)

Everything the node owns is marked as ours (a marker file in the kubelet's root, backing files in one
directory, iptables rules carrying our comment), so cleanup removes exactly that and nothing else.
"""
from __future__ import annotations

import grp
import json
import os
import re
import stat
import subprocess
from pathlib import Path

KUBELET_ROOT = Path("/var/lib/kubelet")
MARKER = KUBELET_ROOT / ".memstrata-e2e"
# The kubelet sets these for its own policy (setupKernelTunables) and never puts them back.
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
# Chains the kubelet makes for itself (kube-proxy --cleanup removes kube-proxy's own).
KUBELET_CHAINS = ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY")


def foreign_node_reason() -> str | None:
    """Why this host must not run the e2e node: a kubelet we did not start, or a kubelet root without our
    marker (a real node's pods, volumes and checkpoints live there). None: it is ours, or nobody's."""
    running = subprocess.run(["pgrep", "-x", "kubelet"], capture_output=True, text=True).stdout.split()
    if running:
        return f"a kubelet is already running here (pid {', '.join(running)}): this host is a node, not ours to reset"
    if KUBELET_ROOT.is_dir() and any(KUBELET_ROOT.iterdir()) and not MARKER.exists():
        return (f"{KUBELET_ROOT} belongs to another kubelet (no {MARKER.name} marker): the e2e node would delete "
                "its pods' state")
    return None


def claim_kubelet_root() -> None:
    KUBELET_ROOT.mkdir(parents=True, exist_ok=True)
    MARKER.write_text("made by memstrata's e2e real node; removed with everything else here\n")
    (KUBELET_ROOT / "device-plugins").mkdir(exist_ok=True)


class HostSettings:
    """The kubelet's sysctls as they were before it started, kept in a file that outlives a killed run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def save(self) -> None:
        if self.path.exists():  # a run died before restoring: what is on the host now is the kubelet's
            self.restore()
        values = {}
        for key in KUBELET_SYSCTLS:
            try:
                values[key] = (Path("/proc/sys") / key).read_text().strip()
            except OSError:
                continue
        self.path.write_text(json.dumps(values))

    def restore(self) -> None:
        if not self.path.exists():
            return
        for key, value in json.loads(self.path.read_text()).items():
            try:
                (Path("/proc/sys") / key).write_text(value)
            except OSError:
                pass  # read-only here: the kubelet could not have changed it either
        self.path.unlink()


def remove_kubelet_iptables() -> None:
    """The kubelet's own chains and the jumps to them, in every table it uses."""
    for table in ("filter", "nat", "mangle"):
        rules = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True).stdout.splitlines()
        for rule in rules:
            if rule.startswith("-A ") and any(f"-j {c}" in rule for c in KUBELET_CHAINS):
                subprocess.run(["iptables", "-t", table, "-D", *rule.split()[1:]], capture_output=True)
        for chain in KUBELET_CHAINS:
            subprocess.run(["iptables", "-t", table, "-F", chain], capture_output=True)
            subprocess.run(["iptables", "-t", table, "-X", chain], capture_output=True)


def kill_pod_processes() -> None:
    """SIGKILL every process in the kubelet's pod cgroups (cgroupfs driver; cgroup v1, this harness's only
    kind): a container survives its shim and containerd, and would keep a device or a port."""
    for procs in Path("/sys/fs/cgroup/pids/kubepods").rglob("cgroup.procs"):
        try:
            pids = procs.read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, PermissionError):
                pass


def kill_shims(socket: Path) -> None:
    shims = subprocess.run(["pgrep", "-f", f"containerd-shim.*-address {socket}"], capture_output=True, text=True)
    for pid in shims.stdout.split():
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, PermissionError):
            pass


def _mount_points() -> list[str]:
    # mountinfo escapes space, tab, newline and backslash as octal (\040); umount needs the real path.
    decode = lambda p: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p)  # noqa: E731
    return [decode(line.split()[4]) for line in Path("/proc/self/mountinfo").read_text().splitlines()]


def unmount_under(root: Path) -> None:
    """Lazily unmount every mount below `root` and on it, deepest first (the kubelet bind-mounts its root
    onto itself, to make it a shared mount)."""
    prefix = str(root).rstrip("/") + "/"
    for target in sorted((m for m in _mount_points() if m.startswith(prefix) or m == str(root)), key=len,
                         reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)


def remove_tree(root: Path) -> None:
    """Delete `root` once nothing is mounted below it; never through a mount (that would delete what a
    volume holds)."""
    unmount_under(root)
    prefix = str(root).rstrip("/") + "/"
    left = [m for m in _mount_points() if m.startswith(prefix) or m == str(root)]
    if left:
        raise RuntimeError(f"cannot remove {root}: still mounted below it: {left[:5]}")
    subprocess.run(["rm", "-rf", "--one-file-system", str(root)], capture_output=True)


def as_udev_makes_them(node: Path) -> None:
    """The ownership a node's udev gives block devices, NVMe namespaces among them: root:disk 0660. A host without
    udev leaves a new loop node root:root 0600, which the training container (a non-root user in group disk)
    cannot open; the harness must not inherit that, so it sets and checks it."""
    disk = grp.getgrnam("disk").gr_gid
    os.chown(node, 0, disk)
    os.chmod(node, 0o660)
    st = node.stat()
    if (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) != (0, disk, 0o660):
        raise RuntimeError(f"{node}: owner {st.st_uid}:{st.st_gid} mode {stat.S_IMODE(st.st_mode):o} after setting "
                           f"root:disk 0660")


class LoopFiles:
    """Loop devices over sparse files in one directory of ours: what the node agent offers as namespaces.
    clear() detaches every loop device backed by a file there (a killed run's too) and deletes the files."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def make(self, count: int, size: int) -> list[str]:
        self.directory.mkdir(parents=True, exist_ok=True)
        names = []
        for i in range(count):
            backing = self.directory / f"ns{i}.img"
            with open(backing, "wb") as f:
                f.truncate(size)
            dev = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", str(backing)],
                                 capture_output=True, text=True)
            if dev.returncode != 0:
                raise RuntimeError(f"losetup {backing}: {dev.stderr.strip()}")
            names.append(Path(dev.stdout.strip()).name)
            as_udev_makes_them(Path(dev.stdout.strip()))
        return names

    def clear(self) -> None:
        prefix = str(self.directory.resolve()) + "/"
        for entry in Path("/sys/block").glob("loop*"):
            try:
                backing = (entry / "loop" / "backing_file").read_text().strip()
            except OSError:
                continue
            if backing.startswith(prefix):
                # A device-error test may have left it read-only; detach works either way, but say so plainly.
                subprocess.run(["blockdev", "--setrw", f"/dev/{entry.name}"], capture_output=True)
                subprocess.run(["losetup", "--detach", f"/dev/{entry.name}"], capture_output=True)
        for f in self.directory.glob("*.img") if self.directory.is_dir() else []:
            f.unlink()
