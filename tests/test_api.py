"""The public API (after griffe): exported once from `lucid_replay.__all__`, every
name documented, every public method documented, every name on an API reference page."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import types
from pathlib import Path

import pytest

import lucid_replay

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"
DIRECTIVE = re.compile(r"^:::\s+lucid_replay\.([A-Za-z_]\w*)\s*$", re.MULTILINE)
PUBLIC = sorted(lucid_replay.__all__)
SUBMODULES = sorted(
    info.name for info in pkgutil.iter_modules(lucid_replay.__path__) if not info.ispkg
)


def _documented_names():
    names = {}
    for page in sorted(REFERENCE.glob("*.md")):
        for name in DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            names.setdefault(name, []).append(page.name)
    return names


def _own_doc(obj):
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return (doc or "").strip()


def _public_members(cls):
    """(qualified name, function) of public methods/properties the package defines on ``cls``."""
    members = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("lucid_replay"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_"):
                continue
            if isinstance(value, property):
                function = value.fget
            elif isinstance(value, classmethod | staticmethod):
                function = value.__func__
            elif isinstance(value, types.FunctionType):
                function = value
            else:
                continue  # attrs slots and other data descriptors are documented on the class
            members.append((f"{klass.__name__}.{name}", function))
    return members


def test_all_is_sorted_unique_and_nonempty():
    """lucid_replay.__all__ is a sorted list without duplicates."""
    assert lucid_replay.__all__
    assert lucid_replay.__all__ == sorted(set(lucid_replay.__all__))


@pytest.mark.parametrize("name", PUBLIC)
def test_every_exported_name_exists_and_has_a_docstring(name):
    """Every __all__ name is a lucid_replay attribute defined in the package, with a docstring."""
    assert hasattr(lucid_replay, name), name
    obj = getattr(lucid_replay, name)
    assert getattr(obj, "__module__", "").startswith("lucid_replay."), obj
    assert _own_doc(obj), f"{name} has no docstring of its own"


@pytest.mark.parametrize("name", [n for n in PUBLIC if isinstance(getattr(lucid_replay, n), type)])
def test_public_methods_of_exported_classes_have_docstrings(name):
    """Every public method and property an exported class defines (or inherits from the
    package) has a docstring."""
    undocumented = [
        qualified
        for qualified, function in _public_members(getattr(lucid_replay, name))
        if not (function.__doc__ or "").strip()
    ]
    assert not undocumented, f"undocumented: {undocumented}"


@pytest.mark.parametrize("name", PUBLIC)
def test_every_exported_name_is_on_a_reference_page(name):
    """Every __all__ name has a `::: lucid_replay.<Name>` directive under docs/reference/."""
    assert name in _documented_names(), f"{name} is on no page of {REFERENCE}"


def test_reference_directives_name_only_exported_objects():
    """Every `::: lucid_replay.<Name>` directive names something in __all__, once."""
    documented = _documented_names()
    assert documented, f"no directives found under {REFERENCE}"
    assert set(documented) <= set(lucid_replay.__all__), set(documented) - set(PUBLIC)
    assert {n: p for n, p in documented.items() if len(p) > 1} == {}


def test_package_namespace_has_no_public_extras():
    """Public non-module attributes of lucid_replay are exactly __all__ (plus __version__)."""
    extras = {
        name
        for name, value in vars(lucid_replay).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert extras == set(lucid_replay.__all__)
    assert isinstance(lucid_replay.__version__, str)


@pytest.mark.parametrize(
    "module",
    SUBMODULES,
)
def test_submodules_export_nothing_beyond_the_package(module):
    """Each submodule declares __all__, and every name in it is re-exported by lucid_replay."""
    imported = importlib.import_module(f"lucid_replay.{module}")
    assert hasattr(imported, "__all__"), f"lucid_replay.{module} has no __all__"
    for name in imported.__all__:
        assert name in lucid_replay.__all__, f"lucid_replay.{module} exports {name}"
        assert getattr(lucid_replay, name) is getattr(imported, name), name


@pytest.mark.parametrize("name", [n for n in PUBLIC if n.endswith("Error")])
def test_exported_errors_derive_from_the_package_base_and_a_builtin(name):
    """Every exported error subclasses LucidReplayError and ValueError, TypeError or KeyError."""
    error = getattr(lucid_replay, name)
    assert issubclass(error, lucid_replay.LucidReplayError)
    if error is not lucid_replay.LucidReplayError:
        assert issubclass(error, ValueError | TypeError | KeyError), inspect.getmro(error)


# ------------------------------------------------------------- lucid_replay.distributed
# Its names are exported from lucid_replay.distributed (not from lucid_replay, which must not
# import it: the core never imports Ray) and documented as `::: lucid_replay.distributed.<Name>`.
DISTRIBUTED_DIRECTIVE = re.compile(r"^:::\s+lucid_replay\.distributed\.([A-Za-z_]\w*)\s*$", re.M)


def _distributed():
    return importlib.import_module("lucid_replay.distributed")


def _distributed_documented():
    names = {}
    for page in sorted(REFERENCE.glob("*.md")):
        for name in DISTRIBUTED_DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            names.setdefault(name, []).append(page.name)
    return names


def test_distributed_all_is_sorted_documented_and_on_a_reference_page():
    """lucid_replay.distributed.__all__ is sorted; each name is defined in the package, has a
    docstring (its public methods too), and is on a reference page, or is a lucid_replay
    name re-exported as it is."""
    distributed = _distributed()
    assert distributed.__all__ == sorted(set(distributed.__all__))
    documented = _distributed_documented()
    for name in distributed.__all__:
        obj = getattr(distributed, name)
        assert obj.__module__.startswith("lucid_replay."), obj
        assert _own_doc(obj), f"{name} has no docstring of its own"
        if getattr(lucid_replay, name, None) is obj:
            continue  # documented with the core (RateLimiterTimeout)
        assert documented.get(name) is not None, f"{name} is on no reference page"
        undocumented = [q for q, f in _public_members(obj) if not (f.__doc__ or "").strip()]
        assert not undocumented, f"undocumented: {undocumented}"
    assert set(documented) <= set(distributed.__all__)
    assert {n: p for n, p in documented.items() if len(p) > 1} == {}


def test_distributed_submodules_declare_all_and_export_only_the_packages_names():
    """Every lucid_replay.distributed submodule declares __all__ within the package's."""
    distributed = _distributed()
    for info in pkgutil.iter_modules(distributed.__path__):
        module = importlib.import_module(f"lucid_replay.distributed.{info.name}")
        assert hasattr(module, "__all__"), info.name
        assert set(module.__all__) <= set(distributed.__all__), info.name


def test_the_core_imports_neither_ray_nor_the_distributed_package():
    """`import lucid_replay` (and `import lucid_replay.distributed`) never imports Ray."""
    import subprocess
    import sys

    code = (
        "import sys, lucid_replay; a = 'ray' in sys.modules; "
        "b = 'lucid_replay.distributed' in sys.modules; "
        "import lucid_replay.distributed; print(a, b, 'ray' in sys.modules)"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert completed.stdout.split() == ["False", "False", "False"]


def test_every_module_is_on_the_architecture_page():
    """The architecture page's module tables name every module of the package, so that it
    changes with the layout it describes."""
    page = (ROOT / "docs" / "contributing" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(\w+)`", page))
    modules = {
        path.stem for path in (ROOT / "lucid_replay").rglob("*.py") if path.stem != "__init__"
    }
    assert sorted(modules - named) == []
