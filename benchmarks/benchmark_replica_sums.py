"""What summing two replicas' weight gradients costs across two worker processes: in-graph sums against collectives.

Two single-thread TensorFlow servers on loopback, as LocalCluster starts them, each
holding one replica's gradients (``--tensors`` matrices of ``dim x dim`` float32):

- in-graph (what ``tfpipe.step.replicated`` does): replica 1's gradient crosses to replica
  0's worker, ``add_n`` there, and the same bytes cross back (the weights replica 1
  reads next step);
- collective: ``CollectiveReduceV2`` (ring) on both workers in one function, this
  process being the only client, the group leader set in every server's config.

    python benchmarks/benchmark_replica_sums.py                       # dims 256, 768, 1024
    python benchmarks/benchmark_replica_sums.py --dims=768 --nocollective
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("dims", ["256", "768", "1024"], "Gradient matrix sizes (dim x dim float32).")
flags.DEFINE_integer("tensors", 16, "Gradient tensors per replica (one per layer).", lower_bound=1)
flags.DEFINE_integer("repeats", 15, "Timed steps per figure (median).", lower_bound=3)
flags.DEFINE_boolean("collective", True, "Also time collective all-reduce (after every in-graph figure).")
flags.DEFINE_integer("collective_timeout", 30, "Seconds a collective may wait for its group.", lower_bound=1)

JOB, LEADER = "worker", "/job:worker/replica:0/task:0"
_SERVER = """
import sys, tensorflow as tf
config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
config.experimental.collective_group_leader = sys.argv[3]
spec = tf.train.ClusterSpec({sys.argv[4]: __import__("json").loads(sys.argv[1])})
server = tf.distribute.Server(spec, job_name=sys.argv[4], task_index=int(sys.argv[2]), config=config)
print("READY", flush=True)
server.join()
"""


def _start_servers(n: int) -> tuple[list[str], list[subprocess.Popen]]:
    """``n`` single-thread servers on loopback, BFC allocator, collective leader task 0; wait until they serve."""
    addresses = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("localhost", 0))
            addresses.append(f"localhost:{s.getsockname()[1]}")
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
    args = [json.dumps(addresses), "", LEADER, JOB]
    procs = []
    for k in range(n):
        args[1] = str(k)
        procs.append(
            subprocess.Popen([sys.executable, "-c", _SERVER, *args], stdout=subprocess.PIPE, text=True, env=env)
        )
    for p in procs:
        if p.stdout.readline().strip() != "READY":
            raise RuntimeError(f"a server did not start (exit code {p.poll()})")
    return addresses, procs


def _median_ms(fn, repeats: int) -> float:
    fn(), fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn().numpy()
        times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


def main(argv: list[str]) -> None:
    """Start two servers; time the in-graph sum of each --dims, then (with --collective) the collective."""
    del argv
    addresses, procs = _start_servers(2)
    try:
        devices = _connect(addresses)
        print(f"2 single-thread workers on loopback, {FLAGS.tensors} gradients per replica; median of {FLAGS.repeats}")
        print("dim  MB per replica  in-graph sum + back (ms)  GB/s moved")
        grads = _time_in_graph(devices)
        if not FLAGS.collective:
            return
        print("dim  collective ring all-reduce (ms)")
        _time_collectives(grads, devices)
    finally:
        for p in procs:
            p.kill()


def _connect(addresses: list[str]) -> tuple[str, str]:
    """Connect this process to the servers at ``addresses`` as the collectives' only client; their two CPUs."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    context.context().configure_collective_ops(collective_leader=LEADER)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec({JOB: addresses}))
    d0, d1 = (f"/job:{JOB}/task:{k}/device:CPU:0" for k in range(2))
    return d0, d1


def _time_in_graph(devices: tuple[str, str]) -> dict[int, list[list[Any]]]:
    """Print each dim's in-graph sum and copy back; return each dim's gradients of both replicas."""
    import tensorflow as tf

    d0, d1 = devices
    grads = {}
    for dim in (int(d) for d in FLAGS.dims):
        pair = []
        for device in (d0, d1):
            with tf.device(device):
                pair.append([tf.Variable(tf.random.normal([dim, dim])) for _ in range(FLAGS.tensors)])
        grads[dim] = pair

        @tf.function
        def in_graph(pair=pair):
            out = []
            for a, b in zip(*pair):
                with tf.device(d0):
                    total = tf.add_n([a * 1.0, b * 1.0])
                with tf.device(d1):
                    out.append(total * 1.0)
            with tf.device(d0):
                return tf.add_n([tf.reduce_sum(t) for t in out])

        ms = _median_ms(in_graph, FLAGS.repeats)
        mb = FLAGS.tensors * dim * dim * 4 / 2**20
        print(f"{dim:4d}  {mb:14.1f}  {ms:24.1f}  {2 * mb / 1024 / (ms / 1e3):10.2f}", flush=True)
    return grads


def _time_collectives(grads: dict[int, list[list[Any]]], devices: tuple[str, str]) -> None:
    """Print each dim's ring all-reduce of ``grads`` over both workers; stop at the first that fails."""
    import tensorflow as tf
    from tensorflow.python.ops import collective_ops

    d0, d1 = devices
    for key, (dim, pair) in enumerate(grads.items()):

        @tf.function
        def collective(pair=pair, key=key):
            out = []
            for k, tensors in enumerate(zip(*pair)):
                for device, t in zip((d0, d1), tensors):
                    with tf.device(device):
                        out.append(
                            collective_ops.all_reduce_v2(
                                t * 1.0,
                                2,
                                1,
                                1000 * key + k + 1,
                                communication_hint="ring",
                                timeout=FLAGS.collective_timeout,
                            )
                        )
            with tf.device(d0):
                return tf.add_n([tf.reduce_sum(t) for t in out])

        try:
            print(f"{dim:4d}  {_median_ms(collective, FLAGS.repeats):.1f}", flush=True)
        except tf.errors.OpError as err:
            lines = [line.strip() for line in err.message.splitlines() if line.strip()]
            why = next((line for line in lines if "timed out" in line), lines[0] if lines else "")
            print(f"{dim:4d}  failed: {type(err).__name__}: {why}")
            return


if __name__ == "__main__":
    app.run(main)
