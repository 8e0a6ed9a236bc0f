"""The package's shape: the public API, the old module paths that still import, one-way layers.

Modules are sized by cohesion, one concept each, not by a line count (issue 65).
"""

import ast
import os

import pytest

import tfpipe
from tests.util import REPO, run_fresh
from tfpipe import _aliases

PACKAGE = os.path.join(REPO, "tfpipe")
# Bottom to top: a module may import its own layer and the layers before it, never a later one.
LAYERS = [
    {"_compat", "_args", "messages"},  # messages: how tfpipe says things, importing nothing of tfpipe
    {"graph"},
    {"distributed"},
    {"backward"},
    {"partition"},
    {"step"},
    {"planning"},
    {"saving", "training", "settings", "recovery", "keras_api", "auto_plan"},
    {"model"},
    {"analysis", "calibration", "fitting", "planner", "__init__", "_aliases"},
]


def _layer(name: str) -> int:
    """The layer index of ``tfpipe.<name>...`` (a subpackage or a top-level module)."""
    for index, members in enumerate(LAYERS):
        if name in members:
            return index
    raise AssertionError(f"tfpipe.{name} is in no layer of tests/unit/test_package.py")


def _modules() -> list[tuple[str, str]]:
    """Every module of the package as (path, its first name under tfpipe: the subpackage or the module)."""
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                found.append((path, os.path.relpath(path, PACKAGE).split(os.sep)[0].removesuffix(".py")))
    return found


def _imports(path: str) -> set[str]:
    """The first names under tfpipe that ``path`` imports (``from tfpipe.step import x`` -> "step")."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tfpipe":
            parts = node.module.split(".")
            names.update([parts[1]] if len(parts) > 1 else [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[1] for a in node.names if a.name.startswith("tfpipe."))
    return names


def test_public_api_is_what_all_names():
    assert sorted(tfpipe.__all__) == [
        "PipelineModel",
        "Plan",
        "balance",
        "cluster",
        "cost",
        "deferred_weights",
        "plan",
        "schedule",
    ]
    for name in tfpipe.__all__:
        assert getattr(tfpipe, name) is not None
    from tfpipe.balance import by_time, partition  # the public modules keep their short paths
    from tfpipe.cluster import LocalCluster, connect

    assert callable(by_time) and callable(partition) and callable(connect) and LocalCluster.__name__ == "LocalCluster"


def test_dependencies_point_one_way():
    upward = []
    for path, name in _modules():
        for imported in _imports(path) - {name}:
            if imported in {"models", "scripts"} or _layer(imported) > _layer(name):
                upward.append(f"{os.path.relpath(path, REPO)} imports tfpipe.{imported}")
    assert not upward, upward


def test_the_manual_stays_short_readme_250_lines_benchmarks_400():
    # a manual, not a diary (issue 41): history goes to docs/notes/
    limits = {"README.md": 250, "docs/benchmarks.md": 400}
    long = {f: n for f, most in limits.items() if (n := len(open(os.path.join(REPO, f)).read().splitlines())) > most}
    assert not long, long


def test_every_old_module_path_imports_the_moved_module_with_a_warning():
    checks = "\n".join(
        f"with pytest.warns(DeprecationWarning, match='tfpipe.{old} moved to {new}'):\n"
        f"    import tfpipe.{old} as old\n"
        f"assert old is importlib.import_module('{new}'), '{old}'"
        for old, new in _aliases.MOVED.items()
    )
    result = run_fresh("import importlib, warnings, pytest, tfpipe\n" + checks + "\nprint('ok')")
    assert result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def test_an_old_module_read_as_an_attribute_warns_and_an_unknown_one_is_an_attribute_error():
    with pytest.warns(DeprecationWarning, match="tfpipe.pipeline moved to tfpipe.step.unrolled"):
        assert tfpipe.pipeline.Pipeline.__module__ == "tfpipe.step.unrolled"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        tfpipe.nothing  # noqa: B018
