"""What a LocalCluster's worker process runs, and how the process that started it reads its allocator's counts.

A worker serves its task with ``tf.distribute.Server`` until stopped. Its parent asks it, one
line on its stdin ("memory" or "reset"), for ``get_memory_info`` of its CPU, which it answers
with one JSON line on its stdout: the bytes its allocator holds and its peak, which no op and no
remote call reads. A pipe, not a port: nothing else can ask.
"""

from __future__ import annotations

import json
import subprocess
import threading
from typing import Any

from tfpipe._compat import runtime
from tfpipe.distributed.faults import WorkerError

JOB = "worker"  # the job name of a LocalCluster's workers
# Run with ``python -c CODE spec_json task threads``: TensorFlow's runtime without its Python API
# (``tfpipe._compat.runtime``, loaded by its path: a worker starts in about a second, not five), a server for the task,
# and the answering thread.
CODE = """
import importlib.util, json, sys, threading
found = importlib.util.spec_from_file_location("tfpipe_worker_runtime", %r)
runtime = importlib.util.module_from_spec(found)
found.loader.exec_module(runtime)
tf = runtime.serving()
spec, task, threads = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
config = tf.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=threads)
server = tf.Server(tf.ClusterSpec(spec), job_name=%r, task_index=task, config=config, start=True)

def answer():
    for line in sys.stdin:
        try:
            if line.strip() == "reset":
                tf.reset_memory_stats("CPU:0")
            info = tf.get_memory_info("CPU:0")
        except Exception as err:  # an allocator that counts nothing (TF_CPU_ALLOCATOR_USE_BFC not true)
            info = {"error": str(err)}
        print(json.dumps(info), flush=True)

threading.Thread(target=answer, daemon=True).start()
print("READY", flush=True)
server.join()
""" % (runtime.__file__, JOB)
_asking = threading.Lock()  # one question and its answer at a time, whichever thread asks


def ask(process: subprocess.Popen, what: str) -> dict[str, Any]:
    """Ask a running worker ``what`` ("memory", or "reset" and then memory) and return its answer."""
    stdin, stdout = process.stdin, process.stdout
    assert stdin is not None and stdout is not None  # LocalCluster starts its workers with both piped
    with _asking:
        try:
            stdin.write(what + "\n")
            stdin.flush()
            line = stdout.readline()
        except (BrokenPipeError, ValueError):  # the worker is gone, or its cluster stopped and closed the pipe
            line = ""
    if not line:
        raise WorkerError(
            f"The worker with pid {process.pid} is not running (exit code {process.poll()}): it cannot say what its "
            "allocator holds. Ask while its LocalCluster runs."
        )
    answer = json.loads(line)
    if "error" in answer:
        raise ValueError(
            f"The worker's allocator counts no bytes ({answer['error']}); LocalCluster's workers count them unless "
            "this process's environment sets TF_CPU_ALLOCATOR_USE_BFC to something other than true."
        )
    return answer
