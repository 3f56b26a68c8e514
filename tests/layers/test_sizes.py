"""The product's modules stay under 400 lines and its functions under 60 (DESIGN.md, "How we write code"): a module
that grows past that holds two concepts, and a function that long does several things no test can reach alone.
Generated code (the gRPC stubs) and tests are not the product."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = (REPO / "operator" / "memstrata", REPO / "runtime" / "memstrata")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def product_modules() -> list[Path]:
    return sorted(p for root in ROOTS for p in root.rglob("*.py")
                  if "proto" not in p.relative_to(root).parts and not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function or method whose definition spans `limit` lines or more,
    decorators and docstring included."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                span = (child.end_lineno or child.lineno) - first + 1
                if span >= limit:
                    found.append((prefix + child.name, span))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(source), "")
    return found


def test_no_product_module_reaches_400_lines() -> None:
    modules = product_modules()
    assert len(modules) > 100, "the walk must see the whole product, or passing proves nothing"
    big = {str(p.relative_to(REPO)): n for p in modules if (n := len(p.read_text().splitlines())) >= MAX_MODULE_LINES}
    assert big == {}, f"split these along a seam: {big}"


def test_no_product_function_reaches_60_lines() -> None:
    long = {f"{p.relative_to(REPO)}:{name}": n for p in product_modules() for name, n in long_functions(p.read_text())}
    assert long == {}, f"split these: {long}"


def test_a_long_method_is_found_with_its_class() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    source = f"class A:\n    @property\n    def f(self):\n{body}\n\ndef g():\n    return 1\n"
    assert long_functions(source) == [("A.f", 62)]
