"""Compile memstrata's .proto files into Python at build time (grpcio-tools).

setup.py uses `BuildPyWithProto` as its build_py command, so `pip install`
(wheel or editable) generates `<name>_pb2.py` and `<name>_pb2_grpc.py` next to
each .proto under memstrata/ before the package's modules are collected. The
generated files are build outputs, never committed. By hand:

    python3 build_proto.py
"""
from __future__ import annotations

import sys
from pathlib import Path

from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# Protos live inside the package they belong to; the include root is the
# portion root (this directory), so generated imports read `from memstrata.nodeagent.proto import ...`.
PROTO_ROOT = ROOT


def _outputs(proto: Path) -> list[Path]:
    return [proto.with_name(proto.stem + "_pb2.py"), proto.with_name(proto.stem + "_pb2_grpc.py")]


def compile_protos(root: Path = PROTO_ROOT, force: bool = False) -> list[Path]:
    """Generate the Python modules of every .proto under `root`; returns those (re)written."""
    protos = sorted(root.glob("memstrata/**/*.proto"))
    stale = [p for p in protos if force or any(
        not out.exists() or out.stat().st_mtime < p.stat().st_mtime for out in _outputs(p))]
    if not stale:
        return []
    try:
        from grpc_tools import protoc
    except ImportError as exc:
        raise SystemExit(f"build_proto: grpcio-tools is needed to compile {stale[0]} ({exc}); "
                         "pip install grpcio-tools") from exc
    # The well-known types (empty.proto, ...) ship inside grpc_tools.
    include = Path(protoc.__file__).parent / "_proto"
    for proto in stale:
        args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={root}", f"--grpc_python_out={root}",
                str(proto.relative_to(root))]
        if protoc.main(args) != 0:
            raise SystemExit(f"build_proto: protoc failed on {proto}")
    return [out for p in stale for out in _outputs(p)]


class BuildPyWithProto(build_py):
    """build_py that compiles the protos first, so the generated modules are packaged."""

    def run(self) -> None:
        for out in compile_protos():
            print(f"build_proto: wrote {out.relative_to(ROOT)}")
        super().run()


if __name__ == "__main__":
    written = compile_protos(force="--force" in sys.argv)
    print("\n".join(f"wrote {p.relative_to(ROOT)}" for p in written) or "protos up to date")
