"""Native extension build. Everything else is declared in pyproject.toml.

The extension is compiled by the package build (pip install), never on import,
so a runtime image starts without a compiler.
"""
import sys
from pathlib import Path

from setuptools import Extension, find_namespace_packages, setup

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

# Two PEP 420 portions of one namespace package `memstrata`: neither root has a
# memstrata/__init__.py, so `operator/` never shadows the stdlib `operator`.
# Each package is mapped to its directory explicitly; setuptools' multi-root
# `find` maps the namespace to one root and then looks for the other root's
# subpackages under it.
ROOTS = ("operator", "runtime")
package_dir = {"memstrata": "runtime/memstrata"}  # memstrata.cli lives in the runtime portion
for root in ROOTS:
    for pkg in find_namespace_packages(root, include=["memstrata.*"]):
        package_dir[pkg] = f"{root}/{pkg.replace('.', '/')}"

setup(
    packages=["memstrata", *sorted(p for p in package_dir if p != "memstrata")],
    package_dir=package_dir,
    ext_modules=ext_modules,
    cmdclass={"build_py": BuildPyWithProto},
)
