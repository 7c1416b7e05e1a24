"""One error tree and distinct module names (issue 54).

Everything plexd raises on purpose derives from `PlexdError`, so a caller (the CLI, the supervisor, the engine)
can tell an operator-readable condition from a bug; and no two modules of plexd share a file name, so a name in a
traceback, a log line or an editor tab says which module it is.

Every module under plexd/ is imported (pkgutil.walk_packages), none skipped: one that cannot be imported here fails
the test, named with its error. `__main__` modules are read, not imported (importing one runs the CLI).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import pkgutil
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import plexd
from plexd.base.errors import PlexdError

# Exception classes that stay outside the tree on purpose: qualified name -> why.
OUTSIDE_THE_TREE = {
    # The test-only fault hook stands for a bug: the supervisor must log it as a crash, with its traceback, which
    # it does only for what is not a PlexdError (tests/unit/test_supervisor.py, tests/e2e/test_connected_lab.py).
    "plexd.node.supervisor.InjectedFault": "stands for a bug; the fault tests exercise the crash path",
}


def _walk() -> tuple[dict[str, ModuleType], dict[str, str], list[pkgutil.ModuleInfo]]:
    """(imported modules by name, modules that could not be imported -> why, every module found)."""
    found: list[pkgutil.ModuleInfo] = []
    unreadable: dict[str, str] = {}

    def onerror(name: str) -> None:  # a package whose __init__ raised while walking
        unreadable[name] = "its package could not be imported while walking plexd"

    for info in pkgutil.walk_packages(plexd.__path__, "plexd.", onerror=onerror):
        found.append(info)
    modules: dict[str, ModuleType] = {"plexd": plexd}
    for info in found:
        if info.name.rpartition(".")[2] == "__main__":
            continue  # read by test_main_modules_define_no_class
        try:
            modules[info.name] = importlib.import_module(info.name)
        except BaseException as exc:  # SystemExit included: a module must not act when imported
            unreadable[info.name] = f"{type(exc).__name__}: {exc}"
    return modules, unreadable, found


MODULES, UNIMPORTABLE, FOUND = _walk()


def _classes(owner: type | ModuleType, module: str) -> list[type]:
    """The classes `module` defines: at its top level and inside its classes."""
    out = []
    for obj in vars(owner).values():
        if inspect.isclass(obj) and obj.__module__ == module and obj not in out:
            out.append(obj)
            out += [c for c in _classes(obj, module) if c not in out]
    return out


def _exception_classes() -> dict[str, type]:
    found = {}
    for name, module in MODULES.items():
        for cls in _classes(module, name):
            if issubclass(cls, BaseException):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


def test_every_plexd_module_is_imported():
    assert len(FOUND) > 100  # the walk saw the package (206 modules when this was written)
    assert not UNIMPORTABLE, "modules of plexd that cannot be imported on this machine (fix or install what they " \
        "need; none is skipped):\n" + "\n".join(f"  {name}: {why}" for name, why in sorted(UNIMPORTABLE.items()))


def test_every_exception_class_of_plexd_derives_from_plexd_error():
    found = _exception_classes()
    assert "plexd.controlplane.client_errors.ControlPlaneError" in found  # the walk saw plexd's exceptions
    outside = sorted(name for name, cls in found.items()
                     if not issubclass(cls, PlexdError) and name not in OUTSIDE_THE_TREE)
    assert not outside, ("exception classes outside the PlexdError tree (derive them from PlexdError, or from a "
                         f"plexd error that does; keep a builtin base beside it where callers catch it): {outside}")


def test_the_exceptions_left_outside_the_tree_still_are():
    found = _exception_classes()
    for name in OUTSIDE_THE_TREE:
        assert name in found, f"{name} is listed in OUTSIDE_THE_TREE but plexd no longer defines it"
        assert not issubclass(found[name], PlexdError), f"{name} is a PlexdError now: drop it from OUTSIDE_THE_TREE"


def _source_files() -> list[Path]:
    return sorted(Path(plexd.__file__).parent.rglob("*.py"))


def _looks_like_an_exception(base: ast.expr) -> bool:
    name = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else ""
    builtin = getattr(builtins, name, None)
    return (name.endswith(("Error", "Exception", "Refused", "Failed"))
            or (inspect.isclass(builtin) and issubclass(builtin, BaseException)))


def test_no_exception_class_is_defined_inside_a_function():
    # A class made when a function runs is not seen by the import walk above: keep exceptions at module level.
    local = []
    for path in _source_files():
        tree = ast.parse(path.read_text(), str(path))
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.ClassDef) and any(_looks_like_an_exception(b) for b in node.bases):
                    local.append(f"{path.relative_to(Path(plexd.__file__).parent.parent)}:{node.lineno} {node.name}")
    assert not local, f"exception classes defined inside functions: {local}"


def test_main_modules_define_no_class():
    mains = [info.name for info in FOUND if info.name.rpartition(".")[2] == "__main__"]
    assert "plexd.__main__" in mains
    for name in mains:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin, name
        tree = ast.parse(Path(spec.origin).read_text(), spec.origin)
        assert not [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)], \
            f"{name} defines a class: move it to a module the walk imports"


def test_module_file_names_are_distinct():
    by_name = defaultdict(list)
    for info in FOUND:
        last = info.name.rpartition(".")[2]
        if not info.ispkg and last != "__main__":
            by_name[last].append(info.name)
    shared = {name: modules for name, modules in sorted(by_name.items()) if len(modules) > 1}
    assert not shared, f"modules of plexd sharing a file name (give each a name that says what it holds): {shared}"
