"""Cells on other hosts: worker servers in network namespaces of their own, each at its own address on a bridge,
the training process outside them, joined with ``connect()`` as a user with two worker hosts would.

Each test runs in a fresh process (connecting changes TensorFlow's process-wide context) that makes its hosts
(``scripts/hosts.py``) and removes them when it ends; the test removes what a killed process left.
"""

from __future__ import annotations

import json

import pytest

from scripts import hosts as hosts_lib
from tests.util import run_fresh

WHY = hosts_lib.available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"simulated hosts need network namespaces: {WHY}")

HEADER = """
import json, os, signal, subprocess, sys, threading, time
import numpy as np, keras, tensorflow as tf
import tfpipe
from scripts.hosts import Hosts
from tests.util import max_rel_error, mlp_layers
from tfpipe.distributed.faults import WorkerError

x = np.random.default_rng(0).normal(size=(24, 5)).astype("float32")
y = np.random.default_rng(1).normal(size=(24, 3)).astype("float32")
"""


def _run(tag: str, body: str, timeout: int = 420) -> dict:
    """``body`` run in a fresh process after HEADER; the JSON it prints last."""
    try:
        proc = run_fresh(HEADER + body.replace("TAG", repr(tag)), timeout=timeout)
    finally:
        hosts_lib.remove(tag)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.heavy(seconds=90)
def test_schedules_a_functional_model_and_replicas_on_two_hosts_train_as_one_process():
    result = _run(
        hosts_lib.new_tag(),
        """
def functional():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    a = keras.layers.Dense(8, activation="tanh")(inputs)
    b = keras.layers.Dense(8, activation="tanh")(a)
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Add()([a, b])))

def reference(make):
    keras.utils.set_random_seed(0)
    model = make()
    model = model if isinstance(model, keras.Model) else keras.Sequential([keras.Input((5,)), *model])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model

def pipelined(make, devices, **options):
    keras.utils.set_random_seed(0)
    model = tfpipe.PipelineModel(make(), devices=devices, **options)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model

out = {}
with Hosts(2, tag=TAG) as hosts:
    devices = tfpipe.cluster.connect(hosts.cluster, timeout=60)
    out["devices"] = devices
    plain = reference(mlp_layers)
    for schedule in ["1f1b", "gpipe_batched_w"]:  # GPipe and zero bubble send as 1F1B does
        # M=3 on batches of 8: uneven micro-batches
        remat = "never" if schedule == "gpipe_batched_w" else "except_last"
        model = pipelined(mlp_layers, devices, balance=[5, 5], num_micro_batches=3, schedule=schedule, remat=remat)
        out[schedule] = max_rel_error(model.get_weights(), plain.get_weights())
    out["predict"] = float(np.max(np.abs(model.predict(x, verbose=0) - plain.predict(x, verbose=0))))
    out["evaluate"] = [model.evaluate(x, y, verbose=0), plain.evaluate(x, y, verbose=0)]
    graph = pipelined(functional, devices, num_partitions=2, num_micro_batches=2)
    out["functional"] = max_rel_error(graph.get_weights(), reference(functional).get_weights())
    out["functional_cells"] = [cell.device for cell in graph.cells]
    replicas = pipelined(mlp_layers, [[devices[0]], [devices[1]]], balance=[10], num_micro_batches=2)
    out["replicas"] = max_rel_error(replicas.get_weights(), plain.get_weights())
    out["client"] = tfpipe._compat.own_address()
print(json.dumps(out))
""",
    )
    assert [d.split("/")[1:3] for d in result["devices"]] == [["job:worker", "task:0"], ["job:worker", "task:1"]]
    for name in ["1f1b", "gpipe_batched_w", "functional", "replicas"]:
        assert result[name] < 1e-5, (name, result)
    assert result["predict"] < 1e-5 and abs(result["evaluate"][0] - result["evaluate"][1]) < 1e-5, result
    assert len(set(result["functional_cells"])) == 2
    # the workers reach the training process at its address on the bridge, not at localhost
    assert result["client"].startswith("10.231.") and result["client"].endswith(tuple("0123456789")), result


@pytest.mark.heavy(seconds=90)
def test_a_link_down_mid_fit_is_a_worker_error_and_with_max_restarts_a_restarted_server_is_picked_up(tmp_path):
    result = _run(
        hosts_lib.new_tag(),
        f"""
def fit(devices, on_batch, backup=None):
    keras.utils.set_random_seed(0)
    model = tfpipe.PipelineModel(mlp_layers(), balance=[5, 5], devices=devices, num_micro_batches=2)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    callbacks = [keras.callbacks.LambdaCallback(on_train_batch_end=on_batch)]
    if backup:
        callbacks.insert(0, keras.callbacks.BackupAndRestore(backup))
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    return model, history

out = {{}}
with Hosts(2, tag=TAG) as hosts:
    devices = tfpipe.cluster.connect(hosts.cluster, timeout=8)
    # the link to host 1 goes down (its cable pulled) after the first batch: the step blocks, the watchdog ends it
    began = time.monotonic()
    try:
        fit(devices, lambda batch, logs: hosts.link(1, False) if batch == 0 else None)
        out["link"] = "trained on"
    except WorkerError as err:
        out["link"] = str(err)
    out["link_s"] = time.monotonic() - began
    hosts.link(1, True)
    hosts.kill(1)
    hosts.start(1)
    devices = tfpipe.cluster.connect(hosts.cluster, timeout=30, max_restarts=1)
    # as numpy now: the restart connects anew, and variables of the old connection cannot be read after it
    reference = fit(devices, lambda batch, logs: None)[0].get_weights()
    done = []

    def kill_and_start_again(batch, logs):
        if batch == 1 and not done:  # a supervisor on host 1 starts its server again 3 s later, same address
            done.append(1)
            hosts.kill(1)
            threading.Timer(3.0, hosts.start, args=(1,)).start()

    model, history = fit(devices, kill_and_start_again, {str(tmp_path / "backup")!r})
    out["epochs"] = history.epoch
    out["restarted"] = max_rel_error(model.get_weights(), reference)
print(json.dumps(out))
""",
    )
    assert "Worker task 1 at 10.231." in result["link"] and result["link_s"] < 60, result
    assert result["epochs"] == [0, 1, 2] and result["restarted"] < 1e-6, result


@pytest.mark.heavy(seconds=60)
def test_a_worker_that_cannot_reach_the_training_process_or_the_next_worker_is_named_before_training():
    result = _run(
        hosts_lib.new_tag(),
        """
import subprocess
out = {}
with Hosts(2, tag=TAG) as hosts:
    try:  # the workers told to reach this process at their own loopback: what connect() did before
        tfpipe.cluster.connect(hosts.cluster, timeout=10, client_address="127.0.0.1")
        out["client"] = "connected"
    except WorkerError as err:
        out["client"] = str(err)
    # host 0 has no route to host 1: the cut between their cells cannot cross
    subprocess.run(["ip", "-n", hosts.namespaces[0], "route", "add", "unreachable", hosts.addresses[1]], check=True)
    began = time.monotonic()
    try:
        tfpipe.cluster.connect(hosts.cluster, timeout=10)
        out["worker"] = "connected"
    except WorkerError as err:
        out["worker"] = str(err)
    out["worker_s"] = time.monotonic() - began
print(json.dumps(out))
""",
    )
    assert (
        result["client"].startswith("worker task 0 at 10.231.")
        and "cannot receive from the training process at 127.0.0.1:" in result["client"]
    ), result
    assert (
        "worker task 1 at 10.231." in result["worker"]
        and "cannot receive from worker task 0 at 10.231." in result["worker"]
    ), result
    assert result["worker_s"] < 40, result
