"""Every private Keras and TensorFlow internal tfpipe relies on, each with why; tests/unit/test_compat.py pins them.

A rename in Keras or TensorFlow must fail loudly here (and in that test), not
silently change what tfpipe does: nothing below falls back quietly.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf
from keras.src import backend as _keras_backend
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context as _tf_context


def in_stateless_scope() -> bool:
    """Whether Keras is tracing symbolically in a StatelessScope (assignments must not happen there).

    Keras exports ``StatelessScope`` but not the query.
    """
    return _keras_backend.in_stateless_scope()


def compiled_loss(model: keras.Model) -> Any:
    """The loss ``compile(loss=...)`` built (a CompileLoss: call it as ``(y, y_pred, sample_weight)``), or None.

    The public ``compute_loss`` also adds ``model.losses``, which re-evaluates every
    weight regularizer on the variables; the pipeline adds those per cell itself.
    """
    return model._compile_loss  # noqa: SLF001


def loss_tracker(model: keras.Model) -> keras.metrics.Mean:
    """The Mean metric that reports ``loss`` in ``fit``'s logs (Keras' train_step updates it)."""
    return model._loss_tracker  # noqa: SLF001


def symbolic_build(model: keras.Model, data_batch: Any) -> None:
    """Create the compiled metrics' and the optimizer's variables from a symbolic batch, as Keras' fit does.

    Done before Keras traces the step: a variable created while tracing makes
    TensorFlow trace the whole unrolled pipeline a second time.
    """
    model._symbolic_build(data_batch=data_batch)  # noqa: SLF001


def gradient_all_reduce(
    optimizer: keras.optimizers.Optimizer,
) -> Callable[[list[tuple[Any, Any]]], list[tuple[Any, Any]]]:
    """The TensorFlow optimizer's sum of (gradient, variable) pairs over replicas, run before every update.

    Under the default strategy it is one ``IdentityN`` over all gradients with no
    device, which TensorFlow places on the client: each gradient would cross to it
    and back. tfpipe calls it per variable device instead (training.py).
    """
    return optimizer._all_reduce_sum_gradients  # noqa: SLF001


def set_gradient_all_reduce(
    optimizer: keras.optimizers.Optimizer, reduce: Callable[[list[tuple[Any, Any]]], list[tuple[Any, Any]]]
) -> None:
    """Replace, on this instance, what ``gradient_all_reduce`` returns."""
    optimizer._all_reduce_sum_gradients = reduce  # noqa: SLF001


def step_counter(optimizer: keras.optimizers.Optimizer) -> Any:
    """The optimizer's own step counter (``iterations`` is it, or it divided by the accumulation steps)."""
    return optimizer._iterations  # noqa: SLF001


@contextlib.contextmanager
def step_counter_as(optimizer: keras.optimizers.Optimizer, value: Any) -> Iterator[None]:
    """Within: the step counter (``step_counter``), which update math reads (Adam's bias correction), is ``value``.

    Keras reads ``optimizer.iterations`` in every variable's update, each read a transfer
    from the client; tfpipe passes one read per device.
    """
    counter = step_counter(optimizer)
    optimizer._iterations = value  # noqa: SLF001
    try:
        yield
    finally:
        optimizer._iterations = counter  # noqa: SLF001


def flatten_layers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """A layer and every layer nested in it (Keras tracks sub-layers privately; ``Model.layers`` is one level)."""
    return list(layer._flatten_layers(include_self=True))  # noqa: SLF001


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


def tpu_cores_per_replica(strategy: tf.distribute.Strategy) -> int:
    """Logical TPU cores per replica of a TPUStrategy (its device assignment is not public)."""
    assignment = strategy.extended._device_assignment  # noqa: SLF001
    return assignment.num_cores_per_replica if assignment is not None else 1


def is_default_strategy(strategy: tf.distribute.Strategy) -> bool:
    """Whether ``strategy`` is TensorFlow's default (no ``strategy.scope()`` entered); its class is not exported."""
    return type(strategy).__name__ == "_DefaultDistributionStrategy"


def execution_order(model: keras.Model) -> list[Any]:
    """The nodes of a Functional model in the order its call runs them (``Functional._run_through_graph``).

    By decreasing depth, each depth in Keras' order, input nodes left out; ``_nodes_by_depth`` is not public.
    """
    by_depth = model._nodes_by_depth  # noqa: SLF001
    return [node for depth in sorted(by_depth, reverse=True) for node in by_depth[depth] if not node.is_input]


def runs_as_functional(model: keras.Model) -> bool:
    """Whether ``model``'s ``call`` is Keras' Functional one (runs its graph), not a subclass's override.

    keras_hub backbones and tasks subclass Functional models without overriding ``call``; the
    Functional class itself is not exported.
    """
    from keras.src.models.functional import Functional

    return type(model).call is Functional.call


def move_variable(variable: keras.Variable, device: str) -> None:
    """Re-create the TensorFlow variable behind a Keras variable on ``device``, with its value.

    Keras creates a variable where its layer is built and has no public way to move it;
    the TensorFlow backend keeps the tf.Variable in ``_value`` and makes it in ``_initialize``.
    """
    old = variable._value  # noqa: SLF001
    with tf.init_scope(), tf.device(device):
        variable._initialize(tf.identity(old.read_value()))  # noqa: SLF001


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
