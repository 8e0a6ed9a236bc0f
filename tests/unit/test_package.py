"""The package's shape: the public API at its public paths, one-way layers.

Modules are sized by cohesion, one concept each, not by a line count (issue 65).
"""

import ast
import importlib
import importlib.util
import os

import pytest

import tfpipe
from tests.util import REPO

PACKAGE = os.path.join(REPO, "tfpipe")
# Bottom to top: a module may import its own layer and the layers before it, never a later one.
LAYERS = [
    {"_compat", "_args", "messages", "leaves"},  # messages: how tfpipe says things, importing nothing of tfpipe
    {"graph"},
    {"distributed", "cluster"},
    {"backward"},
    {"partition"},
    {"step", "schedule", "updates"},
    {"planning", "cost", "balance"},
    {"saving", "training", "settings", "recovery", "keras_api", "auto_plan"},
    {"model"},
    {"analysis", "planner", "__init__"},
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


def _tfpipe_names(node: ast.AST) -> set[str]:
    """The first names under tfpipe that an import node imports (``from tfpipe.step import x`` -> "step")."""
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tfpipe":
        parts = node.module.split(".")
        return {parts[1]} if len(parts) > 1 else {alias.name for alias in node.names}
    if isinstance(node, ast.Import):
        return {a.name.split(".")[1] for a in node.names if a.name.startswith("tfpipe.")}
    return set()


def _imports(path: str) -> tuple[set[str], set[str]]:
    """What ``path`` imports of tfpipe: when it is loaded, and from inside its functions (when they are called)."""
    tree = ast.parse(open(path).read())
    in_functions = [n for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for n in ast.walk(f)]
    called = set().union(*(_tfpipe_names(n) for n in in_functions))
    loaded = set().union(*(_tfpipe_names(n) for n in ast.walk(tree) if n not in in_functions))
    return loaded, called


# The one call that runs upward: plan="auto" plans with tfpipe.planner, which builds models, at the first fit.
CALLS_UP = {("auto_plan", "planner")}


def test_public_api_is_what_all_names():
    assert sorted(tfpipe.__all__) == [
        "NothingFits",
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


def test_dependencies_point_one_way_and_no_module_registers_itself():
    upward = []
    for path, name in _modules():
        loaded, called = _imports(path)
        for imported, when in [(i, "loads") for i in loaded] + [(i, "calls") for i in called - loaded]:
            if imported == name or (when == "calls" and (name, imported) in CALLS_UP):
                continue
            if imported == "models" or _layer(imported) > _layer(name):
                upward.append(f"{os.path.relpath(path, REPO)} {when} tfpipe.{imported}")
    assert not upward, upward
    # nothing is appended to another module's registry when tfpipe is imported (issue 65)
    for path, _ in _modules():
        tree = ast.parse(open(path).read())
        registering = [
            n for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
            and isinstance(n.value.func, ast.Attribute) and n.value.func.attr in ("append", "register", "update")
        ]  # fmt: skip
        assert not registering, f"{os.path.relpath(path, REPO)} registers at import: {ast.unparse(registering[0])}"


def test_the_manual_stays_short_readme_250_lines_benchmarks_400():
    # a manual, not a diary (issue 41): history goes to docs/notes/
    limits = {"README.md": 250, "docs/benchmarks.md": 400}
    long = {f: n for f, most in limits.items() if (n := len(open(os.path.join(REPO, f)).read().splitlines())) > most}
    assert not long, long


def test_internal_paths_of_old_are_gone_and_an_unknown_attribute_is_an_attribute_error():
    # a 0.x library names its API in __all__; internal modules that moved have no second path (issue 65)
    for old in ("pipeline", "cell", "checkpoint", "devices"):
        with pytest.raises(ModuleNotFoundError, match=f"tfpipe.{old}"):
            importlib.import_module(f"tfpipe.{old}")
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        tfpipe.nothing  # noqa: B018


# What scripts/ and benchmarks/ may import of tfpipe besides the public API and the reference models: each internal
# module a tool reads, and why no public one serves (issue 65).
TOOLS_READ = {
    ("scripts/timeline.py", "tfpipe.analysis.graph_tasks"): "the step graph's task scopes, which the timeline draws",
    ("scripts/timeline.py", "tfpipe.step.unrolled"): "from how many tasks the step calls its cells (its ideal)",
    ("scripts/timeline.py", "tfpipe.planning.predict"): "the step's rule for inlining its cells (``inlined``)",
    ("scripts/timeline_analysis.py", "tfpipe.analysis.graph_tasks"): "the timeline's task names and phases",
    ("scripts/plan_measure.py", "tfpipe.planner.calibration"): "steps timed as the planner times them, to compare",
    ("scripts/plan_measure.py", "tfpipe.planning.predict"): "the planner's prediction of a shared allocator's peak",
    ("scripts/plan_measure.py", "tfpipe.planning.search"): "the planner's search re-run under other budgets",
    ("scripts/plan_measure.py", "tfpipe.planner"): "the planner's timing of its shortlist, for the re-run search",
    ("scripts/plan_layers.py", "tfpipe.planning.profile"): "the layers profiled alone, whole and as planning presses",
    ("scripts/plan_layers.py", "tfpipe.planning.progress"): "the bound planning presses the layers' profile to",
    ("scripts/plan_layers.py", "tfpipe.planner.choose"): "the bound max_seconds='auto' gives a step",
    ("scripts/plan_layers.py", "tfpipe.planner.probe_fits"): "the micro-batch sizes the planner profiles at",
    ("scripts/plan_layers.py", "tfpipe.planning.search"): "the micro-batch sizes the planner's search takes",
}
PUBLIC_MODULES = {"tfpipe", *(f"tfpipe.{name}" for name in ("balance", "cluster", "cost", "schedule"))}


def _tool_files() -> list[str]:
    """Every Python file of scripts/ and benchmarks/, relative to the repository."""
    return sorted(
        os.path.relpath(os.path.join(folder, file), REPO)
        for top in ("scripts", "benchmarks")
        for folder, _, files in os.walk(os.path.join(REPO, top))
        for file in files
        if file.endswith(".py")
    )


def _submodule(module: str, name: str) -> str:
    """``module.name`` where that is a module of tfpipe (``from tfpipe.planning import search``), else ``module``."""
    if not module.startswith("tfpipe") or not hasattr(importlib.import_module(module), "__path__"):
        return module  # a module, not a package: what it imports from it are its names
    return f"{module}.{name}" if importlib.util.find_spec(f"{module}.{name}") is not None else module


def test_the_tools_import_the_public_api_and_name_each_internal_module_they_read():
    internal = set()
    for path in _tool_files():
        for node in ast.walk(ast.parse(open(os.path.join(REPO, path)).read())):
            if isinstance(node, ast.ImportFrom) and node.module:  # a submodule by its own name, else the module
                modules = {_submodule(node.module, alias.name) for alias in node.names}
            elif isinstance(node, ast.Import):
                modules = {alias.name for alias in node.names}
            else:
                continue
            for module in modules:
                public = module in PUBLIC_MODULES or module.startswith("tfpipe.models")
                if module.startswith("tfpipe") and not public:
                    internal.add((path, module))
    assert internal == set(TOOLS_READ), sorted(internal ^ set(TOOLS_READ))


def test_no_function_is_over_60_lines():
    # functions are cut where a step ends (issue 65); the library, its models, scripts and benchmarks alike
    files = [p for p, _ in _modules()] + [os.path.join(REPO, p) for p in _tool_files()]
    files += [os.path.join(REPO, "models", f) for f in os.listdir(os.path.join(REPO, "models")) if f.endswith(".py")]
    long = [
        f"{os.path.relpath(path, REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in files
        for node in ast.walk(ast.parse(open(path).read()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert not long, long


def test_no_module_reads_another_modules_private_attributes():
    # a class's private attributes are read in its own module (issue 65); TensorFlow's and Keras' through _compat
    read = []
    for path, name in _modules():
        if name == "_compat":
            continue
        tree = ast.parse(open(path).read())
        own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        own |= {  # what its classes set on themselves, not what it sets on another module's objects
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")
        }  # fmt: skip
        read += [
            f"{os.path.relpath(path, REPO)}:{n.lineno} {ast.unparse(n)}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")) and n.attr not in own
        ]  # fmt: skip
    assert not read, read
