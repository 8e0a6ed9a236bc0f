"""tfpipe/_compat/runtime.py: a worker's server from TensorFlow's runtime alone, without its Python API.

If this fails after upgrading TensorFlow, a module path the runtime imports moved: fix tfpipe/_compat/runtime.py, do
not loosen the test.
"""

import json
import os
import socket

from tests.util import REPO, run_fresh

# Loaded by its path, as a LocalCluster worker loads it: a server starts and its allocator counts, and
# nothing of TensorFlow's Python API (tf.*, tf.keras, tf.data) or of Keras was imported in that process
SERVE = """
import importlib.util, json, sys
found = importlib.util.spec_from_file_location("runtime", %r)
runtime = importlib.util.module_from_spec(found)
found.loader.exec_module(runtime)
tf = runtime.serving()
server = tf.Server(tf.ClusterSpec({"worker": ["localhost:%d"]}), job_name="worker", task_index=0,
                   config=tf.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1))
imported = sorted(m for m in sys.modules if m.startswith(("tensorflow._api", "keras", "tensorflow.python.data")))
print(json.dumps({"imported": imported, "memory": sorted(tf.get_memory_info("CPU:0"))}), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_a_server_starts_from_the_runtime_without_tensorflows_python_api():
    proc = run_fresh(
        SERVE % (os.path.join(REPO, "tfpipe", "_compat", "runtime.py"), _free_port()),
        env={"TF_CPU_ALLOCATOR_USE_BFC": "true"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {"imported": [], "memory": ["current", "peak"]}
