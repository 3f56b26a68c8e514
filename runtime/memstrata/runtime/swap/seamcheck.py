"""How each kind of seam entry is checked against the installed DeepSpeed (see memstrata.runtime.swap.seam).

Names and signatures are checked on the live objects; what a stock method assigns is read from that
method's source with `ast`, because DeepSpeed's constructors do I/O and cannot be run to find out.
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from collections.abc import Callable, Iterable
from types import FunctionType

from memstrata.runtime.swap.seam import SEAM, Dependency, Kind, Mismatch, SeamMismatch

__all__ = ["assigned_attributes", "check", "parameter_names", "resolve", "undecorated"]


def resolve(path: str) -> object:
    """The object at a dotted path: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for j, attr in enumerate(parts[i:], start=i):
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                raise LookupError(f"{'.'.join(parts[:j])} has no attribute {attr!r}") from None
        return obj
    raise LookupError(f"module {parts[0]!r} is not importable")


def undecorated(func: object, name: str) -> object:
    """The function a decorator without functools.wraps (DeepSpeed's instrument_w_nvtx) closes over."""
    func = inspect.unwrap(func)  # type: ignore[arg-type]
    if isinstance(func, FunctionType) and func.__name__ != name:
        inner = [c.cell_contents for c in func.__closure__ or ()
                 if isinstance(getattr(c, "cell_contents", None), FunctionType)]
        named = [f for f in inner if f.__name__ == name]
        if len(named) == 1:
            return named[0]
    return func


def _parameters(func: Callable[..., object], *, bound: bool) -> list[inspect.Parameter]:
    params = list(inspect.signature(func, follow_wrapped=False).parameters.values())
    return params[1:] if bound and params else params


def parameter_names(func: Callable[..., object], *, bound: bool) -> tuple[str, ...]:
    """Parameter names as the seam writes them; `bound` drops the first (self) of a method taken off its class."""
    return tuple(_shown(p) for p in _parameters(func, bound=bound))


def _shown(p: inspect.Parameter) -> str:
    if p.kind is p.VAR_POSITIONAL:
        return f"*{p.name}"
    return f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name


@functools.cache
def _tree(func: FunctionType) -> ast.FunctionDef | ast.AsyncFunctionDef:
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(func))).body[0]
    except (OSError, SyntaxError) as exc:  # e.g. an install with .pyc files only
        raise LookupError(f"the source of {func.__qualname__} cannot be read ({exc})") from None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise LookupError(f"{func.__qualname__}: source is not a function definition")
    return node


def _targets(node: ast.AST) -> Iterable[ast.expr]:
    if isinstance(node, ast.Assign):
        for target in node.targets:
            yield from _flatten(target)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        yield node.target


def _flatten(target: ast.expr) -> Iterable[ast.expr]:
    if isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _flatten(element)
    elif isinstance(target, ast.Starred):
        yield from _flatten(target.value)
    else:
        yield target


def _mangled(name: str, cls: type) -> str:
    if name.startswith("__") and not name.endswith("__"):
        return f"_{cls.__name__.lstrip('_')}{name}"
    return name


def assigned_attributes(cls: type, method: str, on: str = "self") -> frozenset[str]:
    """Names `<on>.<name> = ...` assigns in `method` of `cls`, and for `self`, in each DeepSpeed base class's
    `method` too (their __init__ chain runs through super()). Private names come back mangled."""
    owners = [c for c in cls.__mro__ if method in vars(c) and c.__module__.startswith("deepspeed")] if on == "self" \
        else [cls]
    names: set[str] = set()
    for owner in owners:
        func = undecorated(getattr(owner, method), method)
        if not isinstance(func, FunctionType):
            continue
        for node in ast.walk(_tree(func)):
            for target in _targets(node):
                if isinstance(target, ast.Attribute) and ast.unparse(target.value) == on:
                    names.add(_mangled(target.attr, owner))
    return frozenset(names)


def _loop_calls(func: FunctionType) -> tuple[str, ...] | None:
    """`self.<m>(...)` calls, in source order, inside `for ... in enumerate(self.fp16_groups)`; None: no such loop."""
    for node in ast.walk(_tree(func)):
        if isinstance(node, ast.For) and ast.unparse(node.iter) == "enumerate(self.fp16_groups)":
            calls = [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                     and ast.unparse(n.func.value) == "self"]
            calls.sort(key=lambda n: (n.lineno, n.col_offset))
            return tuple(n.func.attr for n in calls)  # type: ignore[attr-defined]
    return None


def _check_signature(entry: Dependency, func: Callable[..., object], bound: bool) -> list[str]:
    try:
        params = _parameters(func, bound=bound)
    except (ValueError, TypeError) as exc:
        return [f"its signature cannot be read ({exc})"]
    found = tuple(_shown(p) for p in params)
    expected = entry.params or ()
    # DeepSpeed calls a wrapped or overridden method as it calls its own: any change matters. memstrata calls
    # the others itself: what it passes must keep its place, and nothing new may be required.
    exact = entry.kind in (Kind.WRAPPED, Kind.OVERRIDDEN)
    if found != expected if exact else found[:len(expected)] != expected:
        more = "" if exact else ", ..."
        return [f"parameters are ({', '.join(found)}), memstrata expects ({', '.join(expected)}{more})"]
    required = [p.name for p in params[len(expected):]
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return [f"now requires ({', '.join(required)}), which memstrata does not pass"] if required else []


def _check_loop(entry: Dependency, func: FunctionType) -> list[str]:
    try:
        found = _loop_calls(func)
    except LookupError as exc:
        return [str(exc)]
    if found is None:
        return ["has no `for ... in enumerate(self.fp16_groups)` sub-group loop any more"]
    if found != entry.loop:
        return [f"its sub-group loop calls ({', '.join(found)}), memstrata re-maps ({', '.join(entry.loop or ())})"]
    return []


def _check_callable(entry: Dependency, owner: object) -> list[str]:
    func = undecorated(getattr(owner, entry.name), entry.name)
    if not callable(func):
        return [f"is no longer callable ({type(func).__name__})"]
    problems = []
    if entry.params is not None:
        bound = inspect.isclass(owner) and isinstance(inspect.getattr_static(owner, entry.name), FunctionType)
        problems += _check_signature(entry, func, bound)
    if entry.loop is not None and isinstance(func, FunctionType):
        problems += _check_loop(entry, func)
    return problems


def _check_entry(entry: Dependency) -> list[str]:
    try:
        owner = resolve(entry.owner)
    except LookupError as exc:
        return [f"{entry.owner} is gone: {exc}"]
    if entry.kind in (Kind.ATTRIBUTE, Kind.RECREATED, Kind.SKIPPED):
        if not inspect.isclass(owner) or entry.set_in is None or not hasattr(owner, entry.set_in):
            return [f"{entry.owner}.{entry.set_in} is gone"]
        try:
            assigned = assigned_attributes(owner, entry.set_in, entry.on)
        except LookupError as exc:
            return [str(exc)]
        if entry.name not in assigned:
            return [f"{entry.owner}.{entry.set_in} no longer assigns {entry.on}.{entry.name}"]
        return []
    if not hasattr(owner, entry.name):
        return ["is gone"]
    if entry.kind in (Kind.REBOUND, Kind.IMPORTED):
        if entry.same_as is not None:
            try:
                same = resolve(entry.same_as)
            except LookupError as exc:
                return [f"{entry.same_as} is gone: {exc}"]
            if getattr(owner, entry.name) is not same:
                return [f"no longer holds {entry.same_as}, the class memstrata's replacement subclasses"]
        return []
    return _check_callable(entry, owner)


def _unaccounted(seam: Iterable[Dependency]) -> list[Mismatch]:
    """Attributes a skipped stock method now assigns that the seam neither re-creates nor skips: memstrata's
    subclass would lack them, and stock code reading them would fail mid-step."""
    declared: dict[tuple[str, str], set[str]] = {}
    for entry in seam:
        if entry.kind in (Kind.RECREATED, Kind.SKIPPED) and entry.set_in is not None:
            declared.setdefault((entry.owner, entry.set_in), set()).add(entry.name)
    out = []
    for (owner_path, method), names in declared.items():
        try:
            owner = resolve(owner_path)
        except LookupError:
            continue  # reported per entry
        if not inspect.isclass(owner) or not hasattr(owner, method):
            continue
        try:
            assigned = assigned_attributes(owner, method)
        except LookupError:
            continue  # reported per entry
        for extra in sorted(assigned - names):
            out.append(Mismatch(f"{owner_path}.{method}", f"now also assigns self.{extra}, which memstrata's "
                                "subclass skips this method and does not set"))
    return out


def check(seam: Iterable[Dependency]) -> list[Mismatch]:
    entries = list(seam)
    out = [Mismatch(entry.path, problem, entry) for entry in entries for problem in _check_entry(entry)]
    return out + _unaccounted(entries)


def verify() -> None:
    """Check every entry of SEAM against the installed DeepSpeed; raise SeamMismatch listing all that differ."""
    import deepspeed

    mismatches = check(SEAM)
    if mismatches:
        raise SeamMismatch(str(deepspeed.__version__), mismatches)


_verified = False


def ensure_verified() -> None:
    """verify(), once per process: the installed DeepSpeed does not change under a running process."""
    global _verified
    if not _verified:
        verify()
        _verified = True
