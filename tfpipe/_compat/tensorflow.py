"""Every private TensorFlow internal tfpipe relies on, each with why; tests/unit/compat/test_tensorflow.py pins them."""

from __future__ import annotations

import contextlib
import copy
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context as _tf_context
from tensorflow.python.framework import ops as _tf_ops


def function_graph(graph: tf.Graph, name: str) -> tf.Graph | None:
    """The FuncGraph of the function ``name`` registered in ``graph``, or None (no public lookup by name)."""
    found = graph._get_function(name)  # noqa: SLF001
    return None if found is None else found.graph


@contextlib.contextmanager
def eager_thread_settings(threads: int) -> Iterator[None]:
    """Report ``threads`` as this process's intra- and inter-op pool sizes while connecting to a cluster.

    Remote eager contexts size their pools from the config the client sends when it
    connects (its own settings), not from their servers' ConfigProto; this process's
    pools already exist and do not change. ``tf.config.threading`` refuses to set them
    once the context is initialized, so the private fields are the only way.
    """
    ctx = _tf_context.context()
    saved = ctx._intra_op_parallelism_threads, ctx._inter_op_parallelism_threads  # noqa: SLF001
    ctx._intra_op_parallelism_threads = ctx._inter_op_parallelism_threads = threads  # noqa: SLF001
    try:
        yield
    finally:
        ctx._intra_op_parallelism_threads, ctx._inter_op_parallelism_threads = saved  # noqa: SLF001


@contextlib.contextmanager
def custom_gradients_forgotten() -> Iterator[None]:
    """Remove from TensorFlow's gradient registry, on leaving, what ``tf.custom_gradient`` registered meanwhile.

    Traced in a graph, every call of a ``tf.custom_gradient`` function (Keras' own layers make some) registers its
    gradient under a new name in a process-wide registry that TensorFlow never empties; the gradient closes over the
    traced graph, and the graph over every variable it captured. So a model trained in a ``tf.function`` and then
    let go keeps its weights and optimizer slots in memory for good (measured: 12 x Dense(512) with SGD, 14 MiB after
    ``del`` and ``gc.collect()``). Only for graphs that are not differentiated again after the block: the planner's
    probes, each let go once timed.
    """
    registry = _tf_ops._gradient_registry._registry  # noqa: SLF001 - a dict of name -> registration
    before = set(registry)
    try:
        yield
    finally:
        for name in [n for n in registry if n not in before and n.startswith("CustomGradient-")]:
            del registry[name]


def tpu_cores_per_replica(strategy: tf.distribute.Strategy) -> int:
    """Logical TPU cores per replica of a TPUStrategy (its device assignment is not public)."""
    assignment = strategy.extended._device_assignment  # noqa: SLF001
    return assignment.num_cores_per_replica if assignment is not None else 1


def is_default_strategy(strategy: tf.distribute.Strategy) -> bool:
    """Whether ``strategy`` is TensorFlow's default (no ``strategy.scope()`` entered); its class is not exported."""
    return type(strategy).__name__ == "_DefaultDistributionStrategy"


def backward_function(function: Any) -> Any:
    """The ConcreteFunction TensorFlow differentiates ``function``'s call ops with (built once, then cached).

    Its inputs are the gradients of the trainable outputs, then ``captured_inputs``:
    intermediates that ``function.graph.outputs`` now also lists. The tape's gradient of a
    call op in a graph uses this same pair, so tfpipe.backward.replay can run it without a second
    symbolic differentiation; TensorFlow has no public handle on it.
    """
    return function._delayed_rewrite_functions.forward_backward()[1]  # noqa: SLF001


def tensorflow_gradient(op_type: str) -> Callable[..., Any]:
    """TensorFlow's own registered gradient function for ``op_type`` (an override falls back to it)."""
    from tensorflow.python.framework import ops as _ops

    return _ops._gradient_registry.lookup(op_type)  # noqa: SLF001


def is_trainable(t: tf.Tensor) -> bool:
    """Whether TensorFlow's function gradients take a gradient for an output of ``t``'s dtype."""
    from tensorflow.python.eager import backprop_util

    return backprop_util.IsTrainable(t)


def partition_graphs(fn: Any, *args: Any) -> list[Any]:
    """Run the tf.function ``fn`` eagerly once and return the GraphDefs TensorFlow partitioned it into.

    The only place the runtime shows a device's incarnation, which an explicit ``_Send``
    to another process must name (tfpipe/distributed/sendrecv.py); run metadata is not public API.
    """
    ctx = _tf_context.context()
    ctx.enable_run_metadata()
    try:
        fn(*args)
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    return [graph for function in metadata.function_graphs for graph in function.partition_graphs]


def inserted_sends(fn: Any, *args: Any) -> list[tuple[str, str, int]]:
    """Run the tf.function ``fn`` once: (send device, receive device, sender's incarnation) of each ``_Send``
    TensorFlow inserted between its devices (``partition_graphs``), full device names.
    """
    return [
        (
            node.attr["send_device"].s.decode(),
            node.attr["recv_device"].s.decode(),
            node.attr["send_device_incarnation"].i,
        )
        for graph in partition_graphs(fn, *args)
        for node in graph.node
        if node.op == "_Send"
    ]


def grappler_optimize(graph_def: Any, fetches: Sequence[str], optimizers: Sequence[str]) -> Any:
    """``graph_def`` after Grappler's ``optimizers`` (RewriterConfig names), keeping the nodes ``fetches``.

    Grappler has no public Python entry. ``tf_optimizer.OptimizeGraph`` takes a MetaGraphDef
    whose "train_op" collection names the nodes to keep; given no cluster it provisions a
    session on the machine's devices (GPUs included), so it gets a virtual one-CPU cluster.
    """
    from tensorflow.core.protobuf import device_properties_pb2, meta_graph_pb2
    from tensorflow.python.grappler import cluster as gcluster
    from tensorflow.python.grappler import tf_optimizer

    config = config_pb2.ConfigProto()
    rewrites = config.graph_options.rewrite_options
    rewrites.min_graph_nodes = -1  # Grappler skips graphs under 4 nodes by default
    rewrites.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
    rewrites.optimizers.extend(optimizers)
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph_def)
    meta.collection_def["train_op"].node_list.value.extend(fetches)
    cpu = device_properties_pb2.NamedDevice(name="/job:localhost/replica:0/task:0/device:CPU:0")
    cpu.properties.type = "CPU"
    return tf_optimizer.OptimizeGraph(config, meta, verbose=False, cluster=gcluster.Cluster(devices=[cpu]))


# Dataset transformations that keep batches whole: a remainder batch before them is one after them.
_BATCH_KEEPING = {"_ShuffleDataset", "_PrefetchDataset", "_MapDataset", "_ParallelMapDataset", "CacheDataset",
                  "_CacheDataset", "_OptionsDataset", "_RepeatDataset"}  # fmt: skip


def dataset_batching(dataset: tf.data.Dataset) -> tuple[int, int, bool] | None:
    """(samples, batch size, drop_remainder) of ``dataset.batch(...)`` behind batch-keeping steps, when known.

    tf.data has no public way to ask a batched dataset its batch size; each dataset keeps
    its input in ``_input_dataset`` and a batch its ``_batch_size`` and ``_drop_remainder``.
    """
    node = dataset
    while type(node).__name__ in _BATCH_KEEPING:
        node = getattr(node, "_input_dataset", None)
    if type(node).__name__ not in ("_BatchDataset", "_ParallelBatchDataset"):
        return None
    size, drop = tf.get_static_value(node._batch_size), tf.get_static_value(node._drop_remainder)  # noqa: SLF001
    samples = int(node._input_dataset.cardinality())  # noqa: SLF001
    if size is None or drop is None or samples < 0:  # unknown or infinite
        return None
    return samples, int(size), bool(drop)


def call_options() -> bytes:
    """The serialized ConfigProto that TensorFlow puts on a function call op it makes in a graph.

    ``tfpipe.graph.calls`` makes its call ops itself and gives them the same (the user's
    Grappler settings reach the called bodies).
    """
    return _tf_context.context().function_call_options.config_proto_serialized


@contextlib.contextmanager
def fewer_rewrites() -> Iterator[None]:
    """tf.function calls made here, and call ops traced here, carry Grappler's function and TFG optimizers off.

    TensorFlow has no such switch per function: the ConfigProto of a call is the eager
    context's thread-local ``function_call_options``, made from the global config (and
    ``tf.config.optimizer.set_experimental_options`` has no key for the TFG optimizer). Here
    a copy of it, with the user's other settings, replaces it and is put back after.
    """
    ctx = _tf_context.context()
    before = ctx.function_call_options
    config = config_pb2.ConfigProto.FromString(before.config_proto_serialized)
    config.graph_options.rewrite_options.function_optimization = rewriter_config_pb2.RewriterConfig.OFF
    config.graph_options.rewrite_options.disable_tfg_optimizer = True
    options = copy.copy(before)
    options.config_proto_serialized = config
    ctx.function_call_options = options
    try:
        yield
    finally:
        ctx.function_call_options = before


NOINLINE_ATTRIBUTE = "_noinline"  # a function attribute that TensorFlow's call lowering and Grappler honour
XLA_ATTRIBUTE = "_XlaMustCompile"  # the attribute of a function made with tf.function(jit_compile=True)


def noinline() -> dict[str, bool]:
    """The ``tf.function`` ``experimental_attributes`` that keep each call of the function one call op.

    TensorFlow otherwise inlines a called function's body at every call site; a cell's traced
    functions are called once per micro-batch, and the passes over a step graph cost call
    sites x body size (tfpipe.graph.calls, tfpipe.graph.slim). A new dict each time: tf.function keeps it.
    """
    return {NOINLINE_ATTRIBUTE: True}


def is_noinline(function: Any) -> bool:
    """Whether the ConcreteFunction ``function`` was made with ``noinline()`` (TensorFlow will not inline it)."""
    marked = function.function_def.attr.get(NOINLINE_ATTRIBUTE)
    return marked is not None and marked.b


def _types(dtypes: Sequence[tf.DType]) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(type=[d.as_datatype_enum for d in dtypes]))


def run_independently(op: tf.Operation) -> None:
    """Exempt ``op`` from the program-order chain that tf.function's automatic control dependencies put every
    stateful op without resource inputs in; it still runs before the function returns.

    TensorFlow chains such ops (raw ``Send``/``Recv``, calls of functions with an ``Assert``) across
    every device in the order they were made, so one device's op waits for another's made earlier:
    with the batch size known only at run time, Keras' losses trace an ``Assert`` and a replica's
    loss waited for the replica before it. The step orders each device's tasks itself
    (tfpipe.step.chain). The hook is the graph's ``experimental_acd_manager``; outside a
    tf.function there is none and nothing changes.
    """
    manager = getattr(op.graph, "experimental_acd_manager", None)
    if manager is not None:
        manager.run_independently(op)


def call_op(
    graph: tf.Graph, function: Any, inputs: Sequence[tf.Tensor], dtypes: Sequence[tf.DType], stateful: bool
) -> tf.Operation:
    """The call op TensorFlow makes for ``function`` (registered in ``graph``) on ``inputs``, without its shape walk.

    ``_disable_call_shape_inference`` makes TensorFlow's shape refiner skip its walk of the
    called body (``ShapeRefiner::InferShapesForFunction``): the outputs come out unshaped, for
    the caller to set (tfpipe.graph.calls). The other attributes are those of TensorFlow's own
    call op, which has no public Python constructor: ``config_proto`` from ``call_options``, and
    the function's ``_XlaMustCompile`` (compiled by XLA on its device) where it has one.
    """
    op_type = "StatefulPartitionedCall" if stateful else "PartitionedCall"
    attrs = {
        "f": attr_value_pb2.AttrValue(func=attr_value_pb2.NameAttrList(name=function.name)),
        "Tin": _types([t.dtype for t in inputs]),
        "Tout": _types(dtypes),
        "config_proto": attr_value_pb2.AttrValue(s=call_options()),
        "executor_type": attr_value_pb2.AttrValue(s=b""),
        "_disable_call_shape_inference": attr_value_pb2.AttrValue(b=True),
    }
    xla = function.function_def.attr.get(XLA_ATTRIBUTE)
    if xla is not None:
        attrs[XLA_ATTRIBUTE] = xla
    return graph.create_op(op_type, list(inputs), list(dtypes), name=op_type, attrs=attrs)


def send(tensor: tf.Tensor, name: str, send_device: str, incarnation: int, recv_device: str) -> tf.Operation:
    """TensorFlow's transfer kernel ``_Send`` as an op of its own: ``tensor`` to ``recv_device`` under ``name``.

    The raw ops ``Send`` and ``Recv`` are the kernels of the transfers TensorFlow inserts between
    devices; made by tfpipe, the send is part of the producer's task (tfpipe.distributed.sendrecv).
    Both must name the full devices and the sender's incarnation (``partition_graphs`` shows them);
    the step's rendezvous pairs a send with the receive of the same name.
    """
    return tf.raw_ops.Send(
        tensor=tensor,
        tensor_name=name,
        send_device=send_device,
        send_device_incarnation=incarnation,
        recv_device=recv_device,
        client_terminated=False,
    )


def recv(dtype: tf.DType, name: str, send_device: str, incarnation: int, recv_device: str) -> tf.Tensor:
    """The tensor of type ``dtype`` that ``send`` sent under ``name`` (unshaped), received where the device scope is."""
    return tf.raw_ops.Recv(
        tensor_type=dtype,
        tensor_name=name,
        send_device=send_device,
        send_device_incarnation=incarnation,
        recv_device=recv_device,
        client_terminated=False,
    )


def wrap_function(fn: Callable[..., Any], specs: Sequence[tf.TensorSpec]) -> Any:
    """``fn`` traced once into a TF1-style graph (a WrappedFunction) whose parts tfpipe cuts out by hand.

    Unlike a tf.function's graph it may hold ``placeholder``s besides its inputs: the split
    VJP's body makes one per output gradient after tracing the forward (tfpipe.backward.split_vjp).
    """
    return tf.compat.v1.wrap_function(fn, list(specs))


def placeholder(dtype: tf.DType, shape: Any) -> tf.Tensor:
    """A graph input to be fed later, made inside ``wrap_function``'s trace (TF2 has none outside tf.compat.v1)."""
    return tf.compat.v1.placeholder(dtype, shape)


def reconnect() -> None:
    """Connect this process to its cluster anew: a new context id, and remote contexts made again on every worker.

    ``tf.config.experimental_connect_to_cluster`` with an unchanged cluster only updates the
    remote contexts, which a worker restarted at the same address no longer has. This process's
    own task gets a new port, as connecting picks one: the old one stays bound.
    """
    server_def = copy.deepcopy(_tf_context.get_server_def())
    for job in server_def.cluster.job:
        if job.name == server_def.job_name:
            host = job.tasks[server_def.task_index].rsplit(":", 1)[0]  # where the workers reach it: kept
            with socket.socket() as s:
                s.bind(("", 0))
                job.tasks[server_def.task_index] = f"{host}:{s.getsockname()[1]}"
    _tf_context.set_server_def(server_def)


def wait_for_ops() -> None:
    """Block until every op this process has sent, to its own devices and to the workers, has run
    (``context.async_wait``: TensorFlow exports no public way to wait for remote ops)."""
    _tf_context.async_wait()


def server_def_bytes() -> bytes | None:
    """The cluster this process is connected to, serialized (None when not connected): it changes with every
    ``experimental_connect_to_cluster`` that names another cluster or another port of this process's own task."""
    server_def = _tf_context.get_server_def()
    return None if server_def is None else server_def.SerializeToString(deterministic=True)


def own_address() -> str | None:
    """The host:port this process's own task has in the cluster it is connected to (its server listens there once
    it exchanges tensors with the workers); None when not connected."""
    server_def = _tf_context.get_server_def()
    if server_def is None:
        return None
    for job in server_def.cluster.job:
        if job.name == server_def.job_name:
            return job.tasks[server_def.task_index]
    return None
