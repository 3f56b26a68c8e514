"""The operator floor's build: everything is in pyproject.toml except the
build_py command that compiles the kubelet device-plugin protos."""
import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_proto import BuildPyWithProto  # noqa: E402

setup(cmdclass={"build_py": BuildPyWithProto})
