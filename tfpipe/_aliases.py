"""Module paths other than where a module lives: the public short paths, and the old ones (with a warning).

``tfpipe.balance``, ``tfpipe.cost``, ``tfpipe.schedule`` and ``tfpipe.cluster`` are public modules that live in
subpackages; the paths of the flat package before them still import, with a DeprecationWarning naming the new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

PUBLIC = {  # tfpipe.<name> -> where the public module lives
    "balance": "tfpipe.planning.balance",
    "cost": "tfpipe.planning.cost",
    "schedule": "tfpipe.step.schedule",
    "cluster": "tfpipe.distributed.cluster",
}
# tfpipe.<old> -> its module now; removed in tfpipe 0.3.
MOVED = {
    "sequence": "tfpipe.partition.sequence",
    "functional": "tfpipe.partition.functional",
    "routes": "tfpipe.partition.routes",
    "specs": "tfpipe.partition.specs",
    "cell": "tfpipe.partition.cell",
    "stage": "tfpipe.partition.cell",
    "zoo": "tfpipe.partition.hub",
    "flops": "tfpipe.planning.flops",
    "summary": "tfpipe.planning.summary",
    "microbatch": "tfpipe.step.microbatch",
    "state": "tfpipe.partition.state",
    "loss_task": "tfpipe.step.loss",
    "pipeline": "tfpipe.step.unrolled",
    "loop": "tfpipe.step.looped",
    "replicas": "tfpipe.step.replicated",
    "checkpoint": "tfpipe.backward.remat",
    "split": "tfpipe.backward.split_vjp",
    "weight_batch": "tfpipe.backward.batched_w",
    "replay": "tfpipe.backward.replay",
    "calls": "tfpipe.graph.calls",
    "slim": "tfpipe.graph.slim",
    "cpu_gradients": "tfpipe.graph.cpu_gradients",
    "devices": "tfpipe.distributed.devices",
    "health": "tfpipe.distributed.health",
    "sendrecv": "tfpipe.distributed.sendrecv",
    "tasks": "tfpipe.analysis.tasks",
}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``tfpipe.<public>`` and ``tfpipe.<old>`` and hands back the module where it lives (old: with a warning)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != "tfpipe" or (name not in MOVED and name not in PUBLIC):
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        name = spec.name.rpartition(".")[2]
        if name in PUBLIC:
            return importlib.import_module(PUBLIC[name])
        warnings.warn(f"{spec.name} moved to {MOVED[name]}; import it from there.", DeprecationWarning, stacklevel=3)
        return importlib.import_module(MOVED[name])

    def exec_module(self, module: Any) -> None:
        """Nothing to run: the module is the one at the new path."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (it only answers for the ``tfpipe.<name>`` paths above)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())


def attribute(name: str) -> Any:
    """``tfpipe.<old>`` read as an attribute of the package: the moved module, with the same warning."""
    if name not in MOVED:
        raise AttributeError(f"module 'tfpipe' has no attribute {name!r}")
    warnings.warn(f"tfpipe.{name} moved to {MOVED[name]}; import it from there.", DeprecationWarning, stacklevel=3)
    return importlib.import_module(MOVED[name])
