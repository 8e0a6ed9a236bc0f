"""The main job, scripts/train.py: a small run learns; bad flags fail in one line naming the flag."""

import os
import re
import subprocess
import sys

from tests.util import REPO

SCRIPT = os.path.join(REPO, "scripts", "train.py")


def _run(*flags, timeout=300):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_small_default_run_lowers_the_loss():
    proc = _run("--examples=512", "--epochs=2", "--blocks=2", "--verbose=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r"loss ([\d.]+) -> ([\d.]+), accuracy ([\d.]+) -> ([\d.]+)", proc.stdout)
    assert found, proc.stdout
    start, final = float(found.group(1)), float(found.group(2))
    assert final < 0.5 * start
    assert "balance [2, 3] on ['/CPU:0', '/CPU:1'], 4 micro-batches" in proc.stdout
    assert "examples/s" in proc.stdout


def test_bad_flags_name_the_flag():
    proc = _run("--micro_batches=0")
    assert proc.returncode != 0 and "--micro_batches" in proc.stderr
    proc = _run("--balance=2,x")
    assert proc.returncode == 2 and "train.py: error: --balance=2,x" in proc.stderr
    proc = _run("--devices=cpu:two")
    assert proc.returncode == 2 and "--devices=cpu:two" in proc.stderr
    proc = _run("--batch_size=2", "--micro_batches=4")
    assert proc.returncode == 2 and "--batch_size=2 is smaller than --micro_batches=4" in proc.stderr
