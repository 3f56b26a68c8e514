"""The DeepSpeed seam: every internal memstrata relies on is declared, and a DeepSpeed that moved one is named.

Real DeepSpeed throughout; an "upgrade" is simulated by removing or replacing one object of the installed
DeepSpeed for the duration of a test (monkeypatch), or by loading a stock method's own source with one edit.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FunctionType

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "runtime" / "memstrata" / "runtime"

pytestmark = pytest.mark.usefixtures("deepspeed_ready")


def test_the_installed_deepspeed_matches_every_entry() -> None:
    from memstrata.runtime.swap import seam, seamcheck

    seamcheck.verify()
    kinds = {e.kind for e in seam.SEAM}
    assert kinds == set(seam.Kind), f"kinds without an entry: {set(seam.Kind) - kinds}"
    paths = [(e.kind, e.path) for e in seam.SEAM]
    assert len(paths) == len(set(paths)), "an entry is declared twice"


def _mismatches() -> list[tuple[str, str | None]]:
    """(subject, entry path or None) of every mismatch verify() reports."""
    from memstrata.runtime.swap import seam, seamcheck

    with pytest.raises(seam.SeamMismatch) as info:
        seamcheck.verify()
    message = str(info.value)
    for m in info.value.mismatches:
        assert m.subject in message and m.problem in message  # the one error names each, with what changed
    return [(m.subject, m.entry.path if m.entry else None) for m in info.value.mismatches]


def _edited(owner: type, name: str, old: str, new: str, tmp_path: Path) -> FunctionType:
    """Stock method `owner.name` as an upgrade might ship it: its own source with `old` replaced, loaded from a
    file (so the seam reads it like DeepSpeed's). Decorators are dropped; the function is only read, never called."""
    from memstrata.runtime.swap.seamcheck import undecorated

    func = undecorated(getattr(owner, name), name)
    assert isinstance(func, FunctionType)
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    tree.body[0].decorator_list = []  # type: ignore[attr-defined]
    source = ast.unparse(tree)
    assert old in source, f"{old!r} is not in {owner.__name__}.{name}'s source: the simulated upgrade is stale"
    path = tmp_path / f"upgraded_{name}.py"
    path.write_text(source.replace(old, new) + "\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)[name]


Z3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
OPT_SWAPPER = "deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper.PartitionedOptimizerSwapper"


def test_a_rebound_class_that_moved_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.runtime.zero import stage3

    monkeypatch.delattr(stage3, "PartitionedOptimizerSwapper")
    assert _mismatches() == [("deepspeed.runtime.zero.stage3.PartitionedOptimizerSwapper",) * 2]


def test_a_slot_that_holds_another_class_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.runtime.zero import stage3

    # An upgrade that gives ZeRO-3 its own subclass there: memstrata's replacement would drop its behaviour.
    monkeypatch.setattr(stage3, "PipelinedOptimizerSwapper", type("Newer", (stage3.PipelinedOptimizerSwapper,), {}))
    assert _mismatches() == [("deepspeed.runtime.zero.stage3.PipelinedOptimizerSwapper",) * 2]


def test_a_wrapped_method_that_is_gone_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    monkeypatch.delattr(DeepSpeedZeroOptimizer_Stage3, "_offload_grad_partition_at_boundary")
    assert _mismatches() == [(f"{Z3}._offload_grad_partition_at_boundary",) * 2]


def test_a_private_attribute_a_stock_method_stopped_setting_is_named(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Z

    renamed = _edited(Z, "_setup_for_real_optimizer", "self.__param_id_to_grad_partition", "self.__grad_views",
                      tmp_path)
    monkeypatch.setattr(Z, "_setup_for_real_optimizer", renamed)
    assert _mismatches() == [(f"{Z3}._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",) * 2]


def test_a_renamed_attribute_of_a_skipped_constructor_is_named_both_ways(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper

    # memstrata's optimizer swapper skips this __init__ and sets its attributes itself: it must learn both that
    # swap_folder went and that stock code now reads a swap_dir the subclass does not have.
    renamed = _edited(OptimizerSwapper, "__init__", "self.swap_folder", "self.swap_dir", tmp_path)
    monkeypatch.setattr(OptimizerSwapper, "__init__", renamed)
    assert _mismatches() == [(f"{OPT_SWAPPER}.swap_folder",) * 2, (f"{OPT_SWAPPER}.__init__", None)]


def test_a_function_called_positionally_with_a_new_parameter_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.runtime.swap_tensor import utils

    def swap_in_tensors(swap_handle: object, tensor_buffers: object, offsets: object, swap_paths: object) -> None:
        raise AssertionError("only its signature is read")

    monkeypatch.setattr(utils, "swap_in_tensors", swap_in_tensors)
    assert _mismatches() == [("deepspeed.runtime.swap_tensor.utils.swap_in_tensors",) * 2]


def test_a_wrapped_method_whose_signature_changed_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    def _release_sub_group(self: object, sub_group_id: int) -> None:
        raise AssertionError("only its signature is read")

    monkeypatch.setattr(DeepSpeedZeroOptimizer_Stage3, "_release_sub_group", _release_sub_group)
    assert _mismatches() == [(f"{Z3}._release_sub_group",) * 2]


def test_a_step_loop_with_another_call_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Z

    # suborder re-maps the loop's sub-group ids call by call; a call it does not know would see the wrong id.
    upgraded = _edited(Z, "step", "self._optimizer_step(sub_group_id)",
                       "self._optimizer_step(sub_group_id)\n        self._new_hook(sub_group_id)", tmp_path)
    monkeypatch.setattr(Z, "step", upgraded)
    assert _mismatches() == [(f"{Z3}.step",) * 2]


def test_initialize_refuses_a_deepspeed_that_moved_an_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from memstrata.runtime.swap import seamcheck
    from memstrata.runtime.swap.integration import UnsupportedDeepSpeed, initialize

    monkeypatch.setattr(seamcheck, "_verified", False)
    monkeypatch.delattr(DeepSpeedZeroOptimizer_Stage3, "_swappable_optimizer_subgroup")
    # Refused before a process group, a namespace or a pinned byte is made: the config is not even read.
    with pytest.raises(UnsupportedDeepSpeed, match=r"_swappable_optimizer_subgroup \[wrapped\]: is gone"):
        initialize(model=None, config={})


def test_the_rebound_slots_are_exactly_the_rebound_entries() -> None:
    from memstrata.runtime.swap import optimizer, parameters  # noqa: F401  # imported before `before` is taken
    from memstrata.runtime.swap.integration import _swappers_installed
    from memstrata.runtime.swap.seam import SEAM, Kind
    from memstrata.runtime.swap.seamcheck import resolve

    modules = {e.owner for e in SEAM if e.kind in (Kind.REBOUND, Kind.IMPORTED) and inspect.ismodule(resolve(e.owner))}
    before = {(m, k): v for m in modules for k, v in vars(resolve(m)).items()}
    with _swappers_installed():
        changed = {f"{m}.{k}" for m in modules for k, v in vars(resolve(m)).items() if before.get((m, k)) is not v}
    assert changed == {e.path for e in SEAM if e.kind is Kind.REBOUND}


def test_memstrata_overrides_take_the_parameters_deepspeed_passes() -> None:
    from memstrata.runtime.swap.optimizer import ExactBuffers, MemstrataOptimizerSwapper
    from memstrata.runtime.swap.parameters import MemstrataParamSwapper
    from memstrata.runtime.swap.seam import SEAM, Kind
    from memstrata.runtime.swap.seamcheck import parameter_names

    stand_ins = {"deepspeed.runtime.swap_tensor.utils.SwapBufferManager": ExactBuffers}
    checked = 0
    for entry in (e for e in SEAM if e.kind is Kind.OVERRIDDEN):
        ours = stand_ins.get(entry.owner) or next(c for c in (MemstrataOptimizerSwapper, MemstrataParamSwapper)
                                                  if issubclass(c, _cls(entry.owner)))
        assert entry.name in vars(ours), f"{ours.__name__} does not define {entry.name}, which the seam says it does"
        assert parameter_names(getattr(ours, entry.name), bound=True) == entry.params, entry.path
        checked += 1
    assert checked >= 15


# -- the source scan -------------------------------------------------------------------------------------


def _cls(path: str) -> type:
    from memstrata.runtime.swap.seamcheck import resolve

    cls = resolve(path)
    assert inspect.isclass(cls), path
    return cls


@dataclass
class _Uses:
    """What the runtime's source takes from DeepSpeed, and the private names it defines itself."""

    imports: set[str] = field(default_factory=set)  # dotted names bound by `import deepspeed...`/`from deepspeed`
    chains: set[tuple[str, int]] = field(default_factory=set)  # (dotted reference, length of its import's path)
    overrides: set[tuple[str, str]] = field(default_factory=set)  # (DeepSpeed base class, name memstrata redefines)
    private: dict[str, str] = field(default_factory=dict)  # private name -> where it is used
    own: set[str] = field(default_factory=set)


def _chain(node: ast.expr) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _is_private(name: str) -> bool:
    return len(name) > 1 and name.isidentifier() and name.startswith("_") and not (
        name.startswith("__") and name.endswith("__"))


def _self_targets(func: ast.AST) -> Iterator[str]:
    for node in ast.walk(func):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    yield t.attr


def _deepspeed_names(cls: type) -> set[str]:
    """Everything a DeepSpeed class and its DeepSpeed bases have: members, and attributes any method assigns."""
    from memstrata.runtime.swap.seamcheck import assigned_attributes

    names = set(dir(cls))
    for base in (c for c in cls.__mro__ if c.__module__.startswith("deepspeed")):
        for name, member in vars(base).items():
            if isinstance(member, FunctionType):
                names |= assigned_attributes(base, name)
    return names


def _scan(path: Path, uses: _Uses) -> None:
    tree = ast.parse(path.read_text())
    where = str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)
    aliases: dict[str, str] = {}  # local name -> the DeepSpeed dotted name it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "deepspeed":
                    uses.imports.add(a.name)
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "deepspeed"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed":
            for a in node.names:
                uses.imports.add(f"{node.module}.{a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    # A string that keys a subscript is a mapping's key (a JSON file's field), not an attribute's name, unless
    # the mapping is an object's own attributes (`vars(x)[...]`, `x.__dict__[...]`).
    keys = {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript) and not (
        isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name) and n.value.func.id == "vars"
        or isinstance(n.value, ast.Attribute) and n.value.attr == "__dict__")}
    # A piece of an f-string (`f"strata/{k}_held_bytes"`) is no whole name: what it names is known only when it runs.
    keys |= {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):  # each sub-chain too: `a.b.c` is checked as `a.b` and `a.b.c`
            chain = _chain(node)
            if chain and chain[0] in aliases:
                base = aliases[chain[0]]
                uses.chains.add((".".join([base, *chain[1:]]), len(base.split("."))))
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            uses.private.setdefault(node.attr, where)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_private(node.value) \
                and id(node) not in keys:
            uses.private.setdefault(node.value, where)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in (t for target in targets for t in ast.walk(target)):
                if isinstance(t, ast.Attribute) and "memstrata" in t.attr:
                    uses.own.add(t.attr)  # memstrata's names hung on objects it does not own say so
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            uses.own.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            uses.own |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        bases = [aliases[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in aliases]
        protocol = any(isinstance(b, ast.Name) and b.id == "Protocol" for b in cls.bases)
        defined = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        defined |= {t.id for n in cls.body if isinstance(n, ast.AnnAssign) for t in [n.target]
                    if isinstance(t, ast.Name)}
        defined |= set(_self_targets(cls))
        if protocol:  # a Protocol declares DeepSpeed's names; it does not define memstrata's
            uses.private.update({n: where for n in defined if _is_private(n)})
            continue
        stock: set[str] = set().union(*(_deepspeed_names(_cls(b)) for b in bases))
        for name in defined:
            if name in stock:
                uses.overrides |= {(b, name) for b in bases}
            else:
                uses.own.add(name)


def _undeclared(files: list[Path]) -> tuple[list[str], _Uses]:
    """The scan rule (see the test below): what `files` take from DeepSpeed that the seam does not declare."""
    from memstrata.runtime.swap.seam import SEAM
    from memstrata.runtime.swap.seamcheck import resolve

    uses = _Uses()
    for path in files:
        _scan(path, uses)
    mentioned = {s for e in SEAM for s in (e.owner, e.path, e.same_as) if s}
    problems = [f"import {name}" for name in sorted(uses.imports) if name not in mentioned]
    for ref, n in sorted(uses.chains):
        parts = ref.split(".")
        if not any(".".join(parts[:k]) in mentioned for k in range(n + 1, len(parts) + 1)):
            problems.append(f"reference {ref}")
    for base, name in sorted(uses.overrides):
        mro = _cls(base).__mro__
        if not any(e.name == name and resolve(e.owner) in mro for e in SEAM):
            problems.append(f"{base}.{name}, which memstrata overrides or re-creates")
    names = {e.name for e in SEAM} | {e.set_in for e in SEAM if e.set_in}
    problems += [f"private name {n} (in {w})" for n, w in sorted(uses.private.items())
                 if n not in uses.own and n not in names]
    return problems, uses


def test_every_deepspeed_name_the_runtime_uses_is_declared_in_the_seam() -> None:
    """The scan rule. Over runtime/memstrata/runtime/**/*.py:

    1. every name imported from DeepSpeed (`import deepspeed.x`, `from deepspeed.x import y`) must be an
       entry's owner, path or same_as;
    2. every reference through such a name (`dist.all_reduce`, `deepspeed.initialize`,
       `PartitionedParamStatus.NOT_AVAILABLE`) must have, one step past the import or more, a prefix that is
       an entry's owner, path or same_as;
    3. in a class deriving from a DeepSpeed class, every method it defines and every `self.x` it assigns that
       the DeepSpeed class already has (as a member, or as an attribute any of its methods assigns) must be an
       entry of that class or one of its bases: an override or a re-created attribute;
    4. every other private name (`_x` as an attribute or as a string, e.g. for getattr, but not a mapping's
       subscript key other than `vars(x)[...]` or `x.__dict__[...]`) must be an entry's name
       (or the stock method an entry says sets it), unless memstrata defines it: a module-level
       def/class/assignment, a member or `self._x` of a class of its own (Protocol classes declare DeepSpeed's
       names, so theirs count as uses), or an attribute memstrata hangs on a foreign object, which by
       convention has "memstrata" in its name.

    Public attributes read off DeepSpeed objects (`opt.fp16_groups`) are not found by the scan; the seam
    declares them by hand, and protocols.py types them."""
    files = sorted(RUNTIME.rglob("*.py"))
    assert any(f.name == "integration.py" for f in files)
    problems, uses = _undeclared(files)
    assert not problems, "DeepSpeed names used but not declared in memstrata.runtime.swap.seam:\n" + "\n".join(problems)
    # The scan sees what it must, or passing proves nothing.
    assert {"_offload_grad_partition_at_boundary", "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
            "_get_param_swap_info"} <= set(uses.private)
    assert ("deepspeed.runtime.swap_tensor.partitioned_param_swapper.AsyncPartitionedParameterSwapper",
            "_configure_aio") in uses.overrides
    assert ("deepspeed.comm.all_reduce", 2) in uses.chains


def test_the_scan_fails_on_a_new_undeclared_dependency(tmp_path: Path) -> None:
    hook = tmp_path / "newhook.py"
    hook.write_text(textwrap.dedent('''
        from deepspeed import comm as dist
        from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs


        class Swapper(AsyncPartitionedParameterSwapper):
            def swap_into_buffer(self, param, dest_buffer):
                self._memo = self.pending_writes  # memstrata's own: not a DeepSpeed name
                self.pending_reads = 0


        def hook(optimizer):
            dist.barrier()
            return optimizer._partition_all_parameters(), getattr(optimizer, "_get_norm_groups")
        '''))
    problems, _ = _undeclared([hook])
    assert [p.split(" (in ")[0] for p in problems] == [
        "import deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs",
        "reference deepspeed.comm.barrier",
        "deepspeed.runtime.swap_tensor.partitioned_param_swapper.AsyncPartitionedParameterSwapper.pending_reads, "
        "which memstrata overrides or re-creates",
        "deepspeed.runtime.swap_tensor.partitioned_param_swapper.AsyncPartitionedParameterSwapper.swap_into_buffer, "
        "which memstrata overrides or re-creates",
        "private name _get_norm_groups",
        "private name _partition_all_parameters",
    ]
