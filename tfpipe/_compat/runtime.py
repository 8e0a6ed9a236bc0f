"""TensorFlow's runtime without its Python API, for a LocalCluster worker: a server, its config, its allocator's counts.

``import tensorflow`` runs the package's ``__init__``, which imports the whole Python API: 4.3 s of CPU a process on
the 2-core test machine, against 0.7 s for the modules a server needs. A worker only serves what its client sends, so
``serving`` imports those modules under a stand-in ``tensorflow`` package and then does what that ``__init__`` does
for a process that runs ops (TensorFlow 2 behaviour, its dynamic kernels and device plugins). This file imports nothing
when loaded: a worker loads it by its path, without tfpipe's ``__init__`` (which imports TensorFlow and Keras whole).
tests/unit/compat/test_runtime.py pins the module paths.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types


def serving() -> types.SimpleNamespace:
    """What a worker serves with: ``ConfigProto``, ``ClusterSpec``, ``Server``, ``get_memory_info`` and
    ``reset_memory_stats`` (``tf.config.experimental``'s), imported without TensorFlow's Python API where it is not
    imported yet."""
    found = importlib.util.find_spec("tensorflow")
    if found is None or found.origin is None or found.submodule_search_locations is None:
        raise ImportError("TensorFlow is not installed: a LocalCluster worker needs it (pip install tensorflow).")
    if "tensorflow" not in sys.modules:  # submodules import without the package's __init__
        package = types.ModuleType("tensorflow")
        package.__path__ = list(found.submodule_search_locations)
        package.__file__ = found.origin
        sys.modules["tensorflow"] = package
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.compat import v2_compat
    from tensorflow.python.framework import config
    from tensorflow.python.training import server_lib

    v2_compat.enable_v2_behavior()
    _load_kernels(os.path.dirname(found.origin))
    return types.SimpleNamespace(
        ConfigProto=config_pb2.ConfigProto,
        ClusterSpec=server_lib.ClusterSpec,
        Server=server_lib.Server,
        get_memory_info=config.get_memory_info,
        reset_memory_stats=config.reset_memory_stats,
    )


def _load_kernels(package_dir: str) -> None:
    """Load the dynamic kernels and device plugins TensorFlow's ``__init__`` loads for a pip install: its
    ``core/kernels``, a ``tensorflow-plugins`` folder beside it, ``TF_PLUGGABLE_DEVICE_LIBRARY_PATH``."""
    from tensorflow.python.framework import load_library

    kernels = os.path.join(package_dir, "core", "kernels")
    if os.path.exists(kernels):
        load_library.load_library(kernels)
    plugins = os.path.join(os.path.dirname(package_dir), "tensorflow-plugins")
    if os.path.exists(plugins):
        load_library.load_library(plugins)
        load_library.load_pluggable_device_library(plugins)
    if os.getenv("TF_PLUGGABLE_DEVICE_LIBRARY_PATH", ""):
        load_library.load_pluggable_device_library(os.environ["TF_PLUGGABLE_DEVICE_LIBRARY_PATH"])
