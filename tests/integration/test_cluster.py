"""Cells in worker processes: same results as in one process, explicit sends, argument and connect errors, faults.

Every test runs in a fresh process: connecting to a cluster changes TensorFlow's process-wide context.
"""

import os
import re
import subprocess
import sys

import pytest

from tests.util import covering, run_fresh


@pytest.mark.parametrize(  # replicas on workers: tests/integration/test_hosts.py
    "workers,schedule,replicas",
    covering([(3, "gpipe", 1), (3, "zero_bubble", 1), (4, "1f1b", 2)], [(3, "zero_bubble", 1)]),
)
def test_training_on_workers_matches_one_process(workers, schedule, replicas):  # 4 workers: R=2 x K=2
    proc = run_fresh(f"""
        import numpy as np, keras
        import tfpipe
        from tfpipe.cluster import LocalCluster
        from tests.util import max_rel_error, mlp_layers

        keras.utils.set_random_seed(0)
        x = np.random.default_rng(0).normal(size=(10, 5)).astype("float32")
        y = np.random.default_rng(1).normal(size=(10, 3)).astype("float32")
        reference = keras.Sequential([keras.Input((5,))] + mlp_layers())
        start = reference.get_weights()
        reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        reference.fit(x, y, batch_size=10, epochs=2, verbose=0, shuffle=False)
        with LocalCluster({workers}) as cluster:
            k = {workers // replicas}
            devices = [cluster.devices[r * k : (r + 1) * k] for r in range({replicas})]
            model = tfpipe.PipelineModel(mlp_layers(), num_partitions=k, devices=devices if {replicas} > 1
                                         else cluster.devices, num_micro_batches=3, schedule="{schedule}")
            model.build((None, 5))
            model.set_weights(start)
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
            model.fit(x, y, batch_size=10, epochs=2, verbose=0, shuffle=False)
            error = max_rel_error(model.get_weights(), reference.get_weights())
            predicted = np.abs(model.predict(x, verbose=0) - reference.predict(x, verbose=0)).max()
            loss = model.evaluate(x, y, verbose=0)
            places = sorted({{v.value.device for v in model.trainable_variables}})
        print("RESULT", error, predicted, loss)
        print("PLACES", places)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    error, predicted, loss = (float(v) for v in proc.stdout.split("RESULT")[1].split()[:3])
    assert error < 1e-5 and predicted < 1e-5 and loss > 0
    places = proc.stdout.split("PLACES")[1]
    owners = range(workers // replicas)  # replica 0's workers hold the variables, the others none
    assert all((f"/job:worker/replica:0/task:{k}/device:CPU:0" in places) == (k in owners) for k in range(workers))


def test_outputs_and_their_gradients_cross_processes_through_explicit_sends_the_producer_waits_for():
    """Each forward's output goes to the next worker by a Send in the producing task, and each backward's
    input gradient back the same way (tfpipe/distributed/sendrecv.py)."""
    proc = run_fresh("""
        import numpy as np, keras, tensorflow as tf
        import tfpipe
        from tfpipe.distributed import sendrecv
        from tfpipe.cluster import LocalCluster
        from tests.util import mlp_layers

        x = np.zeros((6, 5), "float32"); y = np.zeros((6, 3), "float32")
        with LocalCluster(2) as cluster:
            model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cluster.devices, num_micro_batches=3)
            model.compile(optimizer="sgd", loss="mse")
            model.train_on_batch(x, y)  # learns the endpoints first
            spec = (tf.TensorSpec((6, 5)), tf.TensorSpec((6, 3)))
            graph = tf.function(lambda a, b: model.train_step((a, b))).get_concrete_function(*spec).graph
            ops = graph.get_operations()
            sends = [op for op in ops if op.type == "Send"]  # the raw op; TensorFlow inserts _Send
            waits = [op for op in ops if any(c in sends for c in op.control_inputs)]
            moves = [op for op in ops if op.type in ("Send", "Recv")]
            chained = [op for op in moves if any(c.type in ("Send", "Recv") for c in op.control_inputs)]
            print("RESULT", sendrecv.known(*cluster.devices), len(sends), sum(op.type == "Recv" for op in ops),
                  ",".join(sorted({op.name.split("/")[0] for op in sends})), len(waits), len(chained))
            sendrecv.forget()  # as a custom loop meets it: train_step traced in its own tf.function, nothing learned
            custom = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cluster.devices, num_micro_batches=3)
            custom.compile(optimizer="sgd", loss="mse")
            custom.build((None, 5))
            graph = tf.function(lambda a, b: custom.train_step((a, b))).get_concrete_function(*spec).graph
            print("CUSTOM", sum(op.type == "Send" for op in graph.get_operations()))
            for depth in (4, 8):  # the stateful ops the step itself runs (outside calls), against the weights
                model = tfpipe.PipelineModel(mlp_layers(depth=depth), num_partitions=2, devices=cluster.devices,
                                             num_micro_batches=3)
                model.compile(optimizer="adam", loss="mse")
                model.train_on_batch(x, y)
                graph = tf.function(lambda a, b: model.train_step((a, b))).get_concrete_function(*spec).graph
                stateful = [op for op in graph.get_operations() if op.type.endswith("VariableOp")]
                print("STATEFUL", depth, len(model.trainable_weights), len(stateful))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    known, sends, recvs, scopes, waits, chained = proc.stdout.split("RESULT")[1].split()[:6]
    assert (known, sends, recvs) == ("True", "6", "6")
    assert proc.stdout.split("CUSTOM")[1].split()[0] == "6"  # a custom loop's step sends explicitly too
    assert scopes == "B_1_0,B_1_1,B_1_2,F_0_0,F_0_1,F_0_2"  # in cell 0's forward and cell 1's backward tasks
    assert int(waits) >= 4  # each device's next task waits for its sends
    # and nothing else: not the other sends and receives of the step, each device's after the other's (the order
    # in which tf.function chains stateful ops that touch no variable; 1F1B's steps ran 5-15% longer so)
    assert chained == "0"
    # The step waits for every stateful op it runs itself, and TensorFlow made each wait on a worker's op (weight
    # reads, the optimizer's reads and assignments) a transfer to the client of its own, every step. Run in one
    # call per device (tfpipe/distributed/grouped.py), the step runs none of the workers' itself: their number
    # does not grow with the weights (the client's own remain: the step counter, the loss metric)
    (_, shallow_weights, shallow), (_, deep_weights, deep) = [
        tuple(map(int, line.split()[1:])) for line in proc.stdout.split("\n") if line.startswith("STATEFUL")
    ]
    assert deep_weights > shallow_weights and deep == shallow and shallow <= 8, (shallow, deep)


@pytest.mark.slow  # a Functional model across hosts: test_hosts.py; its skips' routes: test_functional.py
def test_a_functional_model_sends_each_skip_straight_to_the_worker_that_reads_it():
    """A U-Net on 3 workers: cell 0's first skip goes to worker 2 by its own send, not through worker 1."""
    proc = run_fresh("""
        import numpy as np, keras, tensorflow as tf
        import tfpipe
        from tfpipe.models.unet import unet
        from tfpipe.cluster import LocalCluster
        from tests.util import max_rel_error

        def make():
            keras.utils.set_random_seed(3)
            return unet((16, 16, 3), output_channels=2, depth=2, num_convs=1, base_channels=4, batch_norm=False)

        rng = np.random.default_rng(0)
        x = rng.standard_normal((6, 16, 16, 3)).astype("float32")
        y = rng.standard_normal((6, 16, 16, 2)).astype("float32")
        reference = make()
        reference.compile(optimizer="sgd", loss="mse")
        reference.fit(x, y, batch_size=6, epochs=2, verbose=0, shuffle=False)
        with LocalCluster(3) as cluster:
            # 12 nodes: down0 conv+pool, down1 conv+pool | middle, up1 | up0, logits
            model = tfpipe.PipelineModel(make(), balance=[4, 4, 4], devices=cluster.devices, num_micro_batches=2)
            model.compile(optimizer="sgd", loss="mse")
            model.fit(x, y, batch_size=6, epochs=2, verbose=0, shuffle=False)
            error = max_rel_error(model.get_weights(), reference.get_weights())
            spec = (tf.TensorSpec((6, 16, 16, 3)), tf.TensorSpec((6, 16, 16, 2)))
            graph = tf.function(lambda a, b: model.train_step((a, b))).get_concrete_function(*spec).graph
            sends = [op for op in graph.get_operations() if op.type == "Send"]
            workers = [op.get_attr("recv_device").decode().split("task:")[1][0] for op in sends]
            to = sorted({(op.name.split("/")[0], worker) for op, worker in zip(sends, workers)})
            places = sorted({v.value.device.split("/device")[0] for v in model.trainable_variables})
        print("RESULT", error)
        print("SENDS", ";".join(f"{task}>{worker}" for task, worker in to))
        print("PLACES", ",".join(places))  # the model's weights moved to the workers of their cells
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.split("RESULT")[1].split()[0]) < 1e-5
    sends = proc.stdout.split("SENDS")[1].split()[0]
    assert sends.startswith("B_")  # the skip's gradient goes back from worker 2 to worker 0 directly too
    forward = ";".join(s for s in sends.split(";") if s.startswith("F_"))
    assert forward == "F_0_0>1;F_0_0>2;F_0_1>1;F_0_1>2;F_1_0>2;F_1_1>2"
    backward = ";".join(s for s in sends.split(";") if s.startswith("B_"))
    assert backward == "B_1_0>0;B_1_1>0;B_2_0>0;B_2_0>1;B_2_1>0;B_2_1>1"
    places = proc.stdout.split("PLACES")[1].split()[0].split(",")
    assert places == [f"/job:worker/replica:0/task:{k}" for k in range(3)]


def test_cluster_arguments_and_connect_errors():
    from tfpipe import cluster

    with pytest.raises(ValueError, match="num_workers must be an integer >= 1, got 0"):
        cluster.LocalCluster(0)
    with pytest.raises(ValueError, match="threads_per_worker must be an integer >= 1"):
        cluster.LocalCluster(2, threads_per_worker=0)
    with pytest.raises(ValueError, match="The cluster has no job 'worker'"):
        cluster.connect({"ps": ["localhost:1"]})
    for bad in (0, -5, "20", True):
        with pytest.raises(ValueError, match=f"timeout must be a positive number of seconds, .*got {bad!r}"):
            cluster.LocalCluster(2, timeout=bad)
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            cluster.connect({"worker": ["localhost:1"]}, timeout=bad)
    assert cluster.LocalCluster(2).timeout == cluster.DEFAULT_TIMEOUT
    assert cluster.LocalCluster(2, timeout=None).timeout is None
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=f"max_restarts must be an integer >= 0, got {bad!r}. 0: a dead"):
            cluster.LocalCluster(2, max_restarts=bad)
        with pytest.raises(ValueError, match="max_restarts must be an integer >= 0"):
            cluster.connect({"worker": ["localhost:1"]}, max_restarts=bad)
    spent = cluster.LocalCluster(2, max_restarts=0)
    assert spent.max_restarts == 0 and cluster.restartable() is None  # nothing started, nothing to restart
    with pytest.raises(cluster.WorkerError, match="restarted 0 of max_restarts=0 times"):
        spent.restart()  # refused before any process is started
    env = os.environ.pop("TF_CONFIG", None)
    try:
        with pytest.raises(ValueError, match="connect\\(\\) needs a cluster"):
            cluster.connect()
        os.environ["TF_CONFIG"] = "{not json"
        with pytest.raises(ValueError, match='TF_CONFIG=.* has no readable "cluster" entry'):
            cluster.connect()
    finally:
        os.environ.pop("TF_CONFIG", None)
        if env is not None:
            os.environ["TF_CONFIG"] = env


def test_connect_joins_servers_started_elsewhere_from_tf_config():
    import json
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    addresses = [f"localhost:{p}" for p in ports]
    server = (
        "import tensorflow as tf; tf.distribute.Server(tf.train.ClusterSpec({'worker': %r}), "
        "job_name='worker', task_index=%d).join()"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    servers = [subprocess.Popen([sys.executable, "-c", server % (addresses, k)], env=env) for k in range(2)]
    try:
        proc = run_fresh(
            """
            import numpy as np, keras, tfpipe
            devices = tfpipe.cluster.connect()
            print("DEVICES", devices)
            model = tfpipe.PipelineModel([keras.layers.Dense(4), keras.layers.Dense(1)], balance=[1, 1],
                                         devices=devices, num_micro_batches=2)
            model.compile(optimizer="sgd", loss="mse")
            history = model.fit(np.ones((8, 3), "float32"), np.ones((8, 1), "float32"), batch_size=4, verbose=0)
            print("LOSS", history.history["loss"][-1])
        """,
            env={"TF_CONFIG": json.dumps({"cluster": {"worker": addresses}})},
        )
    finally:
        for s in servers:
            s.kill()
            s.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DEVICES ['/job:worker/task:0/device:CPU:0', '/job:worker/task:1/device:CPU:0']" in proc.stdout
    assert float(proc.stdout.split("LOSS")[1]) >= 0


@pytest.mark.parametrize(
    "how", covering(["SIGKILL", "SIGSTOP"], ["SIGKILL"])
)  # a stopped one: tests/unit/distributed/test_health.py
def test_a_killed_or_stopped_worker_ends_fit_naming_the_worker(how):  # a stopped one within its timeout=20
    proc = run_fresh(
        """
        import os, signal, threading, time
        import numpy as np, keras, tfpipe
        from tfpipe.cluster import LocalCluster, WorkerError
        killed = {}
        try:
            with LocalCluster(2, timeout=20) as cluster:
                layers = [keras.layers.Dense(256, activation="tanh") for _ in range(6)] + [keras.layers.Dense(1)]
                model = tfpipe.PipelineModel(layers, num_partitions=2, devices=cluster.devices, num_micro_batches=4)
                model.compile(optimizer="sgd", loss="mse")
                x, y = np.ones((256, 64), "float32"), np.ones((256, 1), "float32")
                model.fit(x, y, batch_size=64, epochs=1, verbose=0)  # traced and running

                def kill():
                    time.sleep(2)
                    killed["at"] = time.monotonic()
                    os.kill(cluster.pids[1], signal.HOW)

                threading.Thread(target=kill, daemon=True).start()
                model.fit(x, y, batch_size=64, epochs=100000, verbose=0)
        except WorkerError as err:
            print("SECONDS", time.monotonic() - killed["at"])
            print("LEFT", [p for p in cluster.pids if os.path.exists(f"/proc/{p}")])  # checked while we live
            print("MESSAGE", err)
    """.replace("HOW", how),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MESSAGE" in proc.stdout, proc.stdout[-2000:]
    seconds = float(proc.stdout.split("SECONDS")[1].split()[0])
    message = proc.stdout.split("MESSAGE")[1]
    if how == "SIGKILL":  # seen at once
        assert seconds < 30 and "task 1 at localhost:" in message and "died" in message
    else:  # silent since its last answer, at most 5 s (a check's period) before the stop
        assert 14 < seconds < 60, seconds
        expected = r"Worker task 1 at localhost:\d+ did not answer for 2\d s \(timeout=20 s\); it was killed"
        assert re.search(expected, message), message
    assert "LEFT []" in proc.stdout  # no worker left behind
    assert "LocalCluster(..., max_restarts=N)" in message and "BackupAndRestore(backup_dir)" in message  # how to


# Resuming by hand on a new cluster; within the same fit: tests/integration/test_recovery.py (in CI).
@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGSTOP"])  # a stopped worker is killed by the watchdog: both faults end alike
def test_resume_after_a_fault_reaches_the_uninterrupted_weights(tmp_path, how):
    proc = run_fresh(
        f"""
        import os, signal, time
        import numpy as np, keras, tfpipe
        from tfpipe.cluster import LocalCluster, WorkerError
        from tests.util import max_rel_error, mlp_layers

        x = np.random.default_rng(0).normal(size=(32, 5)).astype("float32")
        y = np.random.default_rng(1).normal(size=(32, 3)).astype("float32")

        def train(cluster, backup, kill_at_epoch=None):
            keras.utils.set_random_seed(0)
            model = tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cluster.devices, num_micro_batches=2)
            model.build((None, 5))
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
            callbacks = [keras.callbacks.BackupAndRestore(backup)]
            if kill_at_epoch is not None:
                def kill(epoch, logs):
                    if epoch == kill_at_epoch:
                        os.kill(cluster.pids[1], signal.{how})
                        time.sleep(0.5)
                callbacks.append(keras.callbacks.LambdaCallback(on_epoch_begin=kill))
            model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=callbacks)
            return model.get_weights()

        with LocalCluster(2) as cluster:
            reference = train(cluster, {str(tmp_path / "a")!r})
        try:
            with LocalCluster(2, timeout=5) as cluster:
                train(cluster, {str(tmp_path / "b")!r}, kill_at_epoch=2)
        except WorkerError as err:
            print("FAULT", err)
        print("BACKUP", sorted(os.listdir({str(tmp_path / "b")!r})))
        with LocalCluster(2) as cluster:  # a new cluster; BackupAndRestore resumes at epoch 2
            resumed = train(cluster, {str(tmp_path / "b")!r})
        print("ERROR", max_rel_error(resumed, reference))
    """,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAULT Worker task 1 at localhost:" in proc.stdout
    assert ("did not answer for" in proc.stdout) == (how == "SIGSTOP")
    assert "latest.weights.h5" in proc.stdout.split("BACKUP")[1]
    assert float(proc.stdout.split("ERROR")[1]) < 1e-5


@pytest.mark.slow  # 30 s; the ping timeout's options are unit-tested (tests/unit/distributed/test_health.py)
def test_a_stopped_host_ends_fit_through_grpcs_ping_timeout_when_joined_with_connect():
    # Servers started elsewhere cannot be killed: connect(timeout=) sets gRPC's keepalive and ping timeout
    # (TF_GRPC_DEFAULT_OPTIONS) so that TensorFlow's blocked call fails, and fit names the silent task.
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    addresses = [f"localhost:{p}" for p in ports]
    server = (
        "import tensorflow as tf; tf.distribute.Server(tf.train.ClusterSpec({'worker': %r}), "
        "job_name='worker', task_index=%d).join()"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_GRPC_DEFAULT_OPTIONS", None)
    servers = [subprocess.Popen([sys.executable, "-c", server % (addresses, k)], env=env) for k in range(2)]
    try:
        proc = run_fresh(
            f"""
            import os, signal, threading, time
            import numpy as np, keras, tfpipe
            from tfpipe.cluster import WorkerError
            time.sleep(3)  # the servers start
            devices = tfpipe.cluster.connect({{"worker": {addresses!r}}}, timeout=10)
            print("OPTIONS", os.environ["TF_GRPC_DEFAULT_OPTIONS"])
            layers = [keras.layers.Dense(256, activation="tanh") for _ in range(6)] + [keras.layers.Dense(1)]
            model = tfpipe.PipelineModel(layers, num_partitions=2, devices=devices, num_micro_batches=4)
            model.compile(optimizer="sgd", loss="mse")
            x, y = np.ones((256, 64), "float32"), np.ones((256, 1), "float32")
            model.fit(x, y, batch_size=64, epochs=1, verbose=0)
            stopped = {{}}

            def stop():
                time.sleep(2)
                stopped["at"] = time.monotonic()
                os.kill({servers[1].pid}, signal.SIGSTOP)

            threading.Thread(target=stop, daemon=True).start()
            try:
                model.fit(x, y, batch_size=64, epochs=100000, verbose=0)
            except WorkerError as err:
                print("SECONDS", time.monotonic() - stopped["at"])
                print("MESSAGE", err)
            """,
            timeout=240,
        )
    finally:
        for s in servers:
            s.kill()
            s.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "grpc.http2.ping_timeout_ms=3333" in proc.stdout
    assert "MESSAGE" in proc.stdout, proc.stdout[-2000:]
    assert float(proc.stdout.split("SECONDS")[1].split()[0]) < 40
    assert f"Worker task 1 at {addresses[1]} did not answer" in proc.stdout.split("MESSAGE")[1]
