"""Native extension build. Everything else is declared in pyproject.toml.

The extension is compiled by the package build (pip install), never on import,
so a runtime image starts without a compiler.
"""
import sys
from pathlib import Path

from setuptools import Extension, setup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_proto import BuildPyWithProto  # noqa: E402  (the kubelet device-plugin protos)

SOURCES = sorted(str(p) for p in Path("native").glob("*.c"))

ext_modules = []
if SOURCES:
    ext_modules.append(
        Extension(
            "memstrata.runtime._native",
            sources=SOURCES,
            include_dirs=["native"],
            libraries=["uring", "numa"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration", "-std=gnu11"],
        )
    )

setup(ext_modules=ext_modules, cmdclass={"build_py": BuildPyWithProto})
