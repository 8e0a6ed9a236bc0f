"""Resolving cell devices: defaults, validation, errors."""

import pytest

from tests.util import run_fresh
from tfpipe.distributed import devices


def test_default_uses_logical_cpu_devices():
    assert devices.resolve(None, 2) == ["/CPU:0", "/CPU:1"]
    assert devices.available() == ["/CPU:0", "/CPU:1", "/CPU:2", "/CPU:3"]


def test_explicit_devices_are_checked_and_kept():
    assert devices.resolve(["/CPU:3", "/device:CPU:1", "cpu:0"], 3) == ["/CPU:3", "/device:CPU:1", "cpu:0"]
    assert devices.resolve(["/CPU:0", "/CPU:1", "/CPU:2"], 2) == ["/CPU:0", "/CPU:1"]


def test_unknown_device():
    with pytest.raises(ValueError, match=r"Unknown device '/GPU:0'.*TensorFlow sees only \[/CPU:0"):
        devices.resolve(["/GPU:0"], 1)
    with pytest.raises(ValueError, match=r"Unknown device '/job:worker/task:3/device:CPU:0'"):
        devices.resolve(["/job:worker/task:3/device:CPU:0"], 1)
    with pytest.raises(ValueError, match="Cannot parse device"):
        devices.resolve(["CPU:0:7:x"], 1)
    with pytest.raises(TypeError, match="Devices are strings"):
        devices.resolve([0], 1)
    with pytest.raises(TypeError, match="must be a list of device strings"):
        devices.resolve("/CPU:0", 1)


def test_more_cells_than_devices():
    with pytest.raises(ValueError, match=r"3 cells but only 2 devices"):
        devices.resolve(["/CPU:0", "/CPU:1"], 3)
    with pytest.raises(ValueError, match=r"5 cells but only 4 devices"):
        devices.resolve(None, 5)


def test_unsplit_cpu_puts_every_cell_on_cpu0():
    proc = run_fresh("""
        from tfpipe.distributed import devices
        print(devices.resolve(None, 3))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "['/CPU:0', '/CPU:0', '/CPU:0']"


def test_cells_sharing_the_only_device_are_warned_about_once_and_summary_says_what_would_help():
    proc = run_fresh("""
        import warnings
        import tfpipe
        from tests.util import mlp_layers
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            for _ in range(2):  # the same warning is shown once
                model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2)
            tfpipe.PipelineModel(mlp_layers(), num_partitions=1)  # one cell: nothing shared
        for w in caught:
            print("WARNING", w.filename.endswith("<string>"), w.message)
        model.build((None, 8))
        model.summary()
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stdout.splitlines() if line.startswith("WARNING")]
    assert len(warned) == 1 and warned[0].startswith("WARNING True All 2 cells (0-1) go to /CPU:0"), warned
    assert "set_logical_device_configuration" in warned[0]
    assert "num_micro_batches=1 (the default) runs the cells one after another; num_micro_batches=8 would" in (
        proc.stdout
    )
    assert "Cells [0, 1] share /CPU:0 and cannot run at the same time" in proc.stdout
