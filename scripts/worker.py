"""Serve one TensorFlow worker task on this host, for a training process that joins with ``tfpipe.cluster.connect()``.

Run one per worker host, each with the same cluster and its own task index, from ``TF_CONFIG`` or flags:

    TF_CONFIG='{"cluster": {"worker": ["10.0.0.2:2222", "10.0.0.3:2222"]}, "task": {"type": "worker", "index": 0}}' \\
        python scripts/worker.py
    python scripts/worker.py --workers=10.0.0.2:2222,10.0.0.3:2222 --task=1

The server listens on every interface of this host at its task's port, serves until stopped (Ctrl-C, SIGTERM) and
runs whatever the training process sends it: open the port to the training host only (README, "Security").
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from typing import Any

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("workers", None, "The worker job's host:port addresses, in task order (default: TF_CONFIG's).")
flags.DEFINE_integer(
    "task", None, "This host's index among --workers (default: TF_CONFIG's task index).", lower_bound=0
)
flags.DEFINE_integer(
    "threads", 0, "Threads for each kernel and between kernels (0: TensorFlow's default).", lower_bound=0
)
flags.DEFINE_string("job", "worker", "The job name the training process places cells on (connect()'s job).")


def cluster_and_task() -> tuple[dict[str, list[str]], int]:
    """The cluster (the worker job's addresses) and this host's task index, from the flags or ``TF_CONFIG``."""
    if FLAGS.workers:
        if FLAGS.task is None:
            raise app.UsageError("--workers needs --task: this host's index among them")
        cluster, task = {FLAGS.job: list(FLAGS.workers)}, FLAGS.task
    else:
        config = os.environ.get("TF_CONFIG")
        if not config:
            raise app.UsageError("give --workers and --task, or set TF_CONFIG with a cluster and this host's task")
        try:
            parsed = json.loads(config)
            cluster = {FLAGS.job: list(parsed["cluster"][FLAGS.job])}
            task = int(parsed["task"]["index"]) if FLAGS.task is None else FLAGS.task
        except (ValueError, KeyError, TypeError) as err:
            raise app.UsageError(f"TF_CONFIG has no {FLAGS.job!r} job or no task index ({err})") from None
    if task >= len(cluster[FLAGS.job]):
        raise app.UsageError(f"--task={task}: the {FLAGS.job!r} job has {len(cluster[FLAGS.job])} tasks")
    return cluster, task


def serving() -> Any:
    """TensorFlow's runtime without its Python API (``tfpipe/_compat/runtime.py``, loaded by its path beside this
    script: importing tfpipe would import TensorFlow and Keras whole): a server starts in about a second, not five."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tfpipe", "_compat", "runtime.py")
    found = importlib.util.spec_from_file_location("tfpipe_worker_runtime", path)
    assert found is not None and found.loader is not None  # a .py file's path
    runtime = importlib.util.module_from_spec(found)
    found.loader.exec_module(runtime)
    return runtime.serving()


def main(argv: list[str]) -> None:
    """Start the server and serve until stopped."""
    del argv
    cluster, task = cluster_and_task()
    tf = serving()
    config = tf.ConfigProto(intra_op_parallelism_threads=FLAGS.threads, inter_op_parallelism_threads=FLAGS.threads)
    server = tf.Server(tf.ClusterSpec(cluster), job_name=FLAGS.job, task_index=task, config=config)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"serving {FLAGS.job} task {task} at {cluster[FLAGS.job][task]} ({server.target})", flush=True)
    server.join()


if __name__ == "__main__":
    app.run(main)
