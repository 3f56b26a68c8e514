"""The runtime floor's native extension. Everything else is in pyproject.toml.

The extension is compiled by the package build (pip install), never on import,
so a runtime image starts without a compiler. Its C sources live in the
repository's top-level native/ (the runtime is their only user), so this
distribution is built as a wheel from a checkout, never from an sdist; and
it is installed together with the operator floor's wheel from the same checkout
(`memstrata==0.1.0`), as docker/runtime.Dockerfile does, never resolved from an index.
"""
import os
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent
# Relative to this directory: setuptools refuses absolute source paths.
SOURCES = sorted(os.path.relpath(p, HERE) for p in (HERE.parent / "native").glob("*.c"))
if not SOURCES:
    raise SystemExit(f"runtime/setup.py: no C sources in {HERE.parent / 'native'}")

setup(
    ext_modules=[
        Extension(
            "memstrata.runtime._native._core",
            sources=SOURCES,
            include_dirs=[str(HERE.parent / "native")],
            # pthread: the I/O thread fallback (native/threads.c), for when io_uring is refused.
            libraries=["uring", "numa", "pthread"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration", "-std=gnu11"],
        )
    ],
)
