"""A dead worker replaced within the same fit, and SIGTERM: a backup, an exit, and a rerun that goes on exactly.

Every test runs in a fresh process: connecting to a cluster changes TensorFlow's process-wide context.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.util import REPO, run_fresh

# Trains the reference MLP 4 epochs of 4 batches on two LocalCluster workers (no shuffling, no random layers).
TRAIN = """
import os, signal, sys, time
import numpy as np, keras, tfpipe
from tfpipe.cluster import LocalCluster, WorkerError
from tests.util import max_rel_error, mlp_layers

x = np.random.default_rng(0).normal(size=(32, 5)).astype("float32")
y = np.random.default_rng(1).normal(size=(32, 3)).astype("float32")


def train(cluster, backup=None, save_freq="epoch", kill_at=(), on_batch=None):
    keras.utils.set_random_seed(0)
    model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cluster.devices, num_micro_batches=2)
    model.build((None, 5))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    callbacks = [keras.callbacks.BackupAndRestore(backup, save_freq=save_freq)] if backup else []
    now = {"epoch": None}
    pending = list(kill_at)  # (epoch, batch): SIGKILL worker 1 before that batch, once each

    def begin(batch, logs):
        if pending and (now["epoch"], batch) == pending[0]:
            pending.pop(0)
            os.kill(cluster.pids[1], signal.SIGKILL)
            time.sleep(0.5)

    def end(batch, logs):
        if on_batch:
            on_batch(now["epoch"], batch)

    callbacks.append(keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: now.update(epoch=epoch), on_train_batch_begin=begin, on_train_batch_end=end))
    history = model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=callbacks,
                        validation_data=(x[:8], y[:8]))  # evaluate's step too is made anew after a restart
    return model.get_weights(), history
"""


# SIGSTOP: hung, the watchdog (timeout=5) kills it; slow (55 s), as test_cluster's SIGSTOP case covers the detection
@pytest.mark.heavy(seconds=60)
@pytest.mark.parametrize("how", ["SIGKILL", pytest.param("SIGSTOP", marks=pytest.mark.slow)])
def test_a_dead_or_hung_worker_is_replaced_and_the_same_fit_reaches_the_uninterrupted_weights(tmp_path, how):
    # SIGKILL: backups every 3 batches, the last inside epoch 3 (resumed after its first batch); SIGSTOP: at epoch ends.
    save_freq = 3 if how == "SIGKILL" else '"epoch"'
    proc = run_fresh(
        TRAIN.replace("signal.SIGKILL", f"signal.{how}")
        + f"""
with LocalCluster(2) as cluster:
    reference, reference_history = train(cluster)
    reference_val = reference_history.history["val_loss"][-1]
with LocalCluster(2, timeout=5, max_restarts=1) as cluster:
    pids = cluster.pids
    weights, history = train(cluster, {str(tmp_path)!r}, {save_freq}, kill_at=[(2, 2)])
    print("RESULT", cluster.restarts, history.epoch, max_rel_error(weights, reference))
    print("VAL", len(history.history["val_loss"]), history.history["val_loss"][-1] == reference_val)
print("LEFT", [p for p in cluster.pids + pids if os.path.exists(f"/proc/{{p}}")])
""",
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = proc.stdout.split("RESULT")[1].split()
    assert result[0] == "1" and " ".join(result[1:5]) == "[0, 1, 2, 3]", proc.stdout[-2000:]  # History: every epoch
    assert float(result[5]) < 1e-6
    assert "VAL 4 True" in proc.stdout  # every epoch validated, the last as in the uninterrupted run
    # One line per restart, naming the worker and where training goes on (1-based epoch, batches already done).
    logged = [line for line in proc.stderr.splitlines() if "restarting the workers" in line]
    assert len(logged) == 1 and "worker task 1 at localhost:" in logged[0], proc.stderr[-3000:]
    assert "(restart 1 of 1) and resuming from the backup in" in logged[0]
    if how == "SIGKILL":
        assert "died (UnavailableError)" in logged[0] and "at epoch 3, batch 1." in logged[0]
    else:
        assert (
            "did not answer for" in logged[0] and "it was killed" in logged[0] and "at epoch 3, batch 0." in logged[0]
        )
    assert "LEFT []" in proc.stdout


SIGTERMED = """
from tfpipe import recovery

def stop_after(epoch, batch):
    if (epoch, batch) == (1, 1):  # SIGTERM to this process, as a scheduler sends it, after 6 batches
        print("PIDS", cluster.pids, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

with LocalCluster(2) as cluster:
    weights, _ = train(cluster, BACKUP, on_batch=stop_after if not os.path.exists(BACKUP) else None)
    print("DONE", len(weights), flush=True)
"""


@pytest.mark.slow  # 49 s of CPU; a restart from a backup: the dead or hung worker test above, and test_callbacks
@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_sigterm_writes_a_backup_stops_the_workers_and_the_same_command_resumes(tmp_path):
    backup = str(tmp_path / "backup")
    code = textwrap.dedent(TRAIN) + f"BACKUP = {backup!r}\n" + textwrap.dedent(SIGTERMED)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO)
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-3000:]
    assert "DONE" not in first.stdout
    assert "tfpipe: SIGTERM: stopped after epoch 2, batch 2; the backup in" in first.stderr
    with open(os.path.join(backup, "training_metadata.json")) as f:
        assert json.load(f) == {"epoch": 1, "batch": 1, "tfpipe_batches_done": 2}
    pids = eval(first.stdout.split("PIDS")[1].splitlines()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.2)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]  # the workers were stopped
    # The same command again: it resumes 2 batches into epoch 2 and ends with the uninterrupted weights.
    again = code + textwrap.dedent("""
        with LocalCluster(2) as cluster:
            reference, _ = train(cluster)
        print("ERROR", max_rel_error(weights, reference))
    """)
    second = subprocess.run([sys.executable, "-c", again], capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "DONE" in second.stdout and float(second.stdout.split("ERROR")[1]) < 1e-6
    assert not os.path.exists(backup)  # Keras deletes the backup after a finished fit


@pytest.mark.slow  # a restart after connect() is tested across hosts in tests/integration/test_hosts.py (51 s of CPU)
def test_after_connect_fit_waits_for_a_restarted_worker_and_reaches_the_uninterrupted_weights(tmp_path):
    # The workers are plain TensorFlow servers this process starts itself, as a supervisor on each host would.
    proc = run_fresh(
        TRAIN
        + f"""
import socket, subprocess, threading
ports = []
for _ in range(2):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        ports.append(s.getsockname()[1])
addresses = [f"localhost:{{p}}" for p in ports]
code = ("import tensorflow as tf; tf.distribute.Server(tf.train.ClusterSpec({{'worker': %r}}), job_name='worker', "
        "task_index=%d).join()")
servers = {{}}

def serve(k):
    servers[k] = subprocess.Popen([sys.executable, "-c", code % (addresses, k)])

class Joined:  # what train() reads from a cluster
    devices = None
    pids = property(lambda self: [servers[0].pid, servers[1].pid])

try:
    serve(0), serve(1)
    cluster = Joined()
    cluster.devices = tfpipe.cluster.connect({{"worker": addresses}}, timeout=60, max_restarts=1)
    reference, _ = train(cluster)

    def kill_and_serve_again(epoch, batch):
        if (epoch, batch) == (2, 1) and not servers.get("killed"):
            servers["killed"] = True
            servers[1].kill()
            servers[1].wait()
            threading.Timer(3.0, serve, args=(1,)).start()  # back 3 s later, at the same address

    weights, history = train(cluster, {str(tmp_path / "b")!r}, on_batch=kill_and_serve_again)
    print("RESULT", history.epoch, max_rel_error(weights, reference))
finally:
    for p in servers.values():
        if hasattr(p, "kill"):
            p.kill()
""",
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = proc.stdout.split("RESULT")[1].split()
    logged = [line for line in proc.stderr.splitlines() if "reconnecting (restart 1 of 1)" in line]
    assert " ".join(result[:4]) == "[0, 1, 2, 3]" and float(result[4]) < 1e-6, (proc.stdout[-2000:], logged)
    assert len(logged) == 1 and "worker task 1 at localhost:" in logged[0], proc.stderr[-3000:]
    assert "at epoch 3, batch 0." in logged[0]
