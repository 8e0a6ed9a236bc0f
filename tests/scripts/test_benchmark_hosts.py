"""benchmarks/benchmark_hosts.py end to end: both setups in turn on a tiny MLP; a latency the kernel cannot add fails
in one line."""

import re

import pytest

from scripts import hosts
from tests.util import run_script

WHY = hosts.available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"simulated hosts need network namespaces: {WHY}")
TINY = ("--rounds=1", "--steps=3", "--depth=4", "--width=32", "--batch_size=32", "--micro_batches=2")


@pytest.mark.slow  # a benchmark's whole run on two network namespaces (35 s of CPU)
def test_both_setups_run_in_turn_and_the_ratio_is_printed():
    proc = run_script("benchmark_hosts.py", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"round 0: loopback \d+\.\d ms, hosts \d+\.\d ms", proc.stdout), proc.stdout
    assert re.search(
        r"hosts / loopback \d+\.\d\d / \d+\.\d\d / \d+\.\d\d \(min / median / max of 1 rounds\)", proc.stdout
    )


@pytest.mark.slow  # a second whole run of the benchmark, with the delay
def test_a_delay_is_added_where_the_kernel_has_netem_and_named_where_not():
    proc = run_script("benchmark_hosts.py", *TINY, "--delay_ms=1")
    if proc.returncode == 0:  # a kernel with netem: the step pays the latency
        assert "delay 1 ms each way" in proc.stdout, proc.stdout
    else:
        assert "cannot slow host 0's link: tc netem:" in proc.stderr, proc.stderr[-3000:]
