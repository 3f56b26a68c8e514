"""memstrata's locally built images (e2e/realnode/images.py): the archives they travel in, the
configs the Dockerfiles give them, and each image's entrypoint run by the real node's containerd
and runc as the image's own user — the runtime image importing torch, DeepSpeed's prebuilt ops
and the native engine, the operator image without torch.

The archive and config tests need nothing; the container tests share the session's real node
(e2e/realnode/conftest.py: skipped with the reason when it cannot come up, failed under CI=true).
"""
from __future__ import annotations

import hashlib
import io
import json
import re
import subprocess
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from e2e.realnode.conftest import RealCluster
from e2e.realnode.imagebuild import PYTHON, install_wheel
from e2e.realnode.images import CONFIGS, make_image, prune_images
from e2e.realnode.ociarchive import Entry, TreeLayer, stream_archive

REPO = Path(__file__).resolve().parents[2]


# --- archives and configs: no containerd needed ----------------------------------------------

def test_a_generated_layer_streams_the_bytes_its_digest_names(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "m.py").write_text("x = 1\n")
    (tmp_path / "lib" / "link").symlink_to("m.py")
    entries = [Entry("opt/lib"), Entry("opt/lib/link", source=tmp_path / "lib" / "link"),
               Entry("opt/lib/m.py", source=tmp_path / "lib" / "m.py"),
               Entry("opt/bin/tool", data=b"#!/opt/memstrata/bin/python\n", mode=0o755)]
    layer = TreeLayer.measure(entries)
    assert TreeLayer.measure(entries).digest == layer.digest  # same files, same digest

    out = io.BytesIO()
    stream_archive(out, "memstrata.local/t:1", [layer], CONFIGS["operator"])
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as archive:
        blobs = {m.name: archive.extractfile(m).read() for m in archive.getmembers()}  # type: ignore[union-attr]
    for name, data in blobs.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1], f"{name}: content is not its digest"
    index = json.loads(blobs["index.json"])
    assert index["manifests"][0]["annotations"]["io.containerd.image.name"] == "memstrata.local/t:1"
    with tarfile.open(fileobj=io.BytesIO(blobs["blobs/sha256/" + layer.digest.split(":")[1]])) as inner:
        members = {m.name: m for m in inner.getmembers()}
        assert members["opt/lib/link"].issym() and members["opt/lib/link"].linkname == "m.py"
        assert members["opt/bin/tool"].mode == 0o755 and members["opt/lib/m.py"].uid == 0
        assert inner.extractfile("opt/lib/m.py").read() == b"x = 1\n"  # type: ignore[union-attr]

    (tmp_path / "lib" / "m.py").write_text("x = 22\n")
    with pytest.raises(RuntimeError, match="changed since they were measured"):
        stream_archive(io.BytesIO(), "memstrata.local/t:1", [layer], CONFIGS["operator"])


def test_a_tag_names_the_content() -> None:
    layer = TreeLayer.measure([Entry("a", data=b"1")])
    other = TreeLayer.measure([Entry("a", data=b"2")])
    assert make_image("operator", [layer]).ref == make_image("operator", [layer]).ref
    assert make_image("operator", [layer]).ref != make_image("operator", [other]).ref
    assert re.fullmatch(r"memstrata\.local/operator:[0-9a-f]{12}", make_image("operator", [layer]).ref)


def _dockerfile(name: str) -> dict[str, object]:
    """ENTRYPOINT, CMD and USER of the final stage of docker/<name>.Dockerfile."""
    text = (REPO / "docker" / f"{name}.Dockerfile").read_text()
    final = text.rsplit("\nFROM ", 1)[1]
    out: dict[str, object] = {"USER": ""}
    for key in ("ENTRYPOINT", "CMD", "USER", "WORKDIR"):
        m = re.search(rf"^{key} (.+)$", final, re.M)
        if m:
            out[key] = json.loads(m.group(1)) if m.group(1).startswith("[") else m.group(1)
    return out


@pytest.mark.parametrize("name", ["operator", "node-agent", "runtime"])
def test_each_image_runs_what_its_dockerfile_runs(name: str) -> None:
    want, config = _dockerfile(name), CONFIGS[name]
    assert (config.entrypoint, config.cmd, config.user) == (want["ENTRYPOINT"], want["CMD"], want["USER"])
    assert config.workdir == want.get("WORKDIR", "")
    env = dict(e.split("=", 1) for e in config.env)
    assert env["PATH"].startswith("/opt/memstrata/bin:")
    assert env["PYTHONUNBUFFERED"] == env["PYTHONDONTWRITEBYTECODE"] == "1"


def test_an_installed_wheel_gets_a_console_script_for_the_images_python(tmp_path: Path) -> None:
    import zipfile

    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo/__init__.py", "def main():\n    return 0\n")
        z.writestr("demo-1.0.dist-info/entry_points.txt", "[console_scripts]\ndemo = demo:main\n")
        z.writestr("demo-1.0.dist-info/METADATA", "Name: demo\nVersion: 1.0\n")
    install_wheel(wheel, tmp_path / "tree")
    script = tmp_path / "tree" / "opt" / "memstrata" / "bin" / "demo"
    assert script.read_text().startswith(f"#!{PYTHON}\n") and script.stat().st_mode & 0o111
    assert (tmp_path / "tree" / "opt/memstrata/lib/python3.11/site-packages/demo/__init__.py").is_file()


# --- in containers, under the real node's containerd and runc ---------------------------------

def _run(rc: RealCluster, ref: str, *argv: str, timeout: int = 180) -> str:
    """`ctr run --rm` of `ref` with the image's own user and config; CRI ignores such containers."""
    name = f"memstrata-image-test-{uuid.uuid4().hex[:8]}"
    cmd = ["ctr", "--address", str(rc.node.socket), "--namespace", "k8s.io", "run", "--rm", ref, name, *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{ref} {' '.join(argv)}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.realnode
@pytest.mark.cluster
@pytest.mark.slow
def test_operator_image_runs_as_65532_without_torch(real_cluster: RealCluster) -> None:
    ref = real_cluster.images.operator
    out = _run(real_cluster, ref, "sh", "-c", "id -u; memstrata --help; memstrata operator --help >/dev/null; "
               "python -c 'import importlib.util as u; print(\"torch:\", u.find_spec(\"torch\") is not None)'")
    assert out.splitlines()[0] == "65532"
    assert "usage: memstrata" in out and "torch: False" in out


@pytest.mark.realnode
@pytest.mark.cluster
@pytest.mark.slow
def test_node_agent_image_runs_as_root_with_grpc(real_cluster: RealCluster) -> None:
    ref = real_cluster.images.node_agent
    out = _run(real_cluster, ref, "sh", "-c", "id -u; memstrata nodeagent --help; python -c 'import grpc'")
    assert out.splitlines()[0] == "0"
    assert "usage: memstrata nodeagent" in out


@pytest.mark.realnode
@pytest.mark.cluster
@pytest.mark.slow
def test_runtime_image_loads_torch_deepspeed_ops_and_the_native_engine(real_cluster: RealCluster) -> None:
    ref = real_cluster.images.runtime
    # No compiler in the image: an op that was not prebuilt would fail to load, not compile.
    probe = ("import os, torch, deepspeed, memstrata.runtime\n"
             "from memstrata.runtime._native import _core\n"
             "from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder\n"
             "print('ops', CPUAdamBuilder().load(verbose=False).__file__, AsyncIOBuilder().load(verbose=False).__file__)\n"
             "print('native', _core.__file__)\n"
             "print('user', os.getuid(), os.getcwd(), os.environ['MEMSTRATA_SCRATCH'])\n")
    out = _run(real_cluster, ref, "sh", "-c", f"memstrata --help >/dev/null && python -c \"{probe}\"")
    ops = next(line for line in out.splitlines() if line.startswith("ops ")).split()[1:]
    assert [Path(p).parent.name for p in ops] == ["adam", "aio"], out
    assert all(p.startswith("/opt/memstrata/lib/python3.11/site-packages/deepspeed/ops/") for p in ops), out
    assert "native /opt/memstrata/lib/python3.11/site-packages/memstrata/runtime/_native/_core" in out
    assert "user 1000 /home/memstrata /var/tmp/memstrata" in out


@pytest.mark.realnode
@pytest.mark.cluster
@pytest.mark.slow
def test_pause_image_exits_at_once_on_sigterm(real_cluster: RealCluster) -> None:
    ctr = ["ctr", "--address", str(real_cluster.node.socket), "--namespace", "k8s.io"]
    name = f"memstrata-image-test-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([*ctr, "run", "--rm", real_cluster.images.pause, name],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(100):  # the task is up once ctr lists it RUNNING
            tasks = subprocess.run([*ctr, "tasks", "ls"], capture_output=True, text=True).stdout
            if re.search(rf"^{name}\s+\d+\s+RUNNING", tasks, re.M):
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"pause never started: {tasks}")
        began = time.monotonic()
        subprocess.run([*ctr, "tasks", "kill", "--signal", "SIGTERM", name], check=True, capture_output=True)
        assert proc.wait(timeout=10) == 0, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() - began < 5
    finally:
        if proc.poll() is None:
            subprocess.run([*ctr, "tasks", "kill", "--signal", "SIGKILL", name], capture_output=True)
            proc.wait(timeout=30)


@pytest.mark.realnode
@pytest.mark.cluster
@pytest.mark.slow
def test_an_earlier_builds_image_is_pruned_and_a_hand_tag_kept(real_cluster: RealCluster) -> None:
    ctr = ["ctr", "--address", str(real_cluster.node.socket), "--namespace", "k8s.io", "images"]
    images = real_cluster.images
    old, hand = "memstrata.local/pause:000000000000", "memstrata.local/pause:by-hand"
    for tag in (old, hand):
        subprocess.run([*ctr, "tag", "--force", images.pause, tag], check=True, capture_output=True)
    try:
        assert old in prune_images(str(real_cluster.node.socket), images)
        refs = subprocess.run([*ctr, "ls", "-q"], check=True, capture_output=True, text=True).stdout.split()
        assert old not in refs and hand in refs and images.pause in refs
    finally:
        subprocess.run([*ctr, "rm", old, hand], capture_output=True)
