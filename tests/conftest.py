"""Test setup: hide GPUs, and split the CPU into 4 logical devices before TensorFlow initializes.

The tests put cells on logical CPU devices and compare them with plain Keras references. On a
machine with a GPU, TensorFlow would run every op not pinned to a cell (the references) on the
GPU, and the tests would compare CPU arithmetic with GPU arithmetic. So the suite, and every
process it starts, sees no GPU; tests/gpu/test_gpu.py gives them back to its own processes.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TFPIPE_TEST_CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# One thread per kernel and one to run ops, here and in every process the tests start (they inherit it): the suite
# runs three test processes on two cores, each with worker processes and scripts of its own, and threads beyond the
# cores oversubscribe them (measured: the suite's test time 1,732 s against 2,201 s with TensorFlow's default
# kernel threads; with one op thread too, 17:54 against 18:56 wall and 34:56 against 36:51 CPU, one run each on
# the AMD machine, 2026-12-02). The tests check results, not overlap: ops of logical devices taking turns gives the
# same numbers.
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_DEVICES = 4
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * NUM_DEVICES
)


def pytest_collection_modifyitems(config, items):
    """Tests under tests/scripts/ run the scripts and benchmarks end to end: marked ``smoke`` (-m "not smoke")."""
    scripts = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts") + os.sep
    for item in items:
        if str(item.path).startswith(scripts):
            item.add_marker(pytest.mark.smoke)


def pytest_configure(config):
    config.pluginmanager.register(HeavyFirst(), "tfpipe_heavy_first")


class HeavyFirst:
    """Tests marked ``heavy`` start first, spread over the test processes (``heavy_first``); after -m has deselected
    what it does, so that the shares counted are the ones run."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        workers = getattr(config, "workerinput", {}).get("workercount", 1)
        items[:] = heavy_first(items, workers)


def heavy_first(items: list, workers: int) -> list:
    """``items`` reordered so that each of ``workers`` processes starts its share with the modules that have heavy tests
    (marked ``heavy(seconds)``; a module's tests together, so that its fixtures are made once), the longest dealt
    first to the process with the least.

    pytest-xdist hands each process a contiguous share of the collection (as many tests each) and idle processes
    take tests from the end of the others' shares: a heavy test at the end of a share started last and the suite
    ended on it (measured: two one-minute planning tests ran alone for the suite's last minute).
    """
    weights: dict[str, float] = {}
    for item in items:
        if marker := item.get_closest_marker("heavy"):
            weights[item.module.__name__] = weights.get(item.module.__name__, 0.0) + marker.kwargs.get("seconds", 30)
    if workers < 2 or not weights:
        return items
    groups = {name: (seconds, [i for i in items if i.module.__name__ == name]) for name, seconds in weights.items()}
    heads: list[list] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for seconds, group in sorted(groups.values(), key=lambda g: -g[0]):
        least = loads.index(min(loads))
        heads[least] += group
        loads[least] += seconds
    light = [item for item in items if item.module.__name__ not in weights]
    ordered, pending = [], len(items)
    for w in range(workers):  # the shares as xdist's worksteal scheduler cuts them
        size = pending // (workers - w)
        take = max(size - len(heads[w]), 0)
        ordered += heads[w] + light[:take]
        light = light[take:]
        pending -= size
    return ordered + light
