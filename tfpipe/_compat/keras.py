"""Every private Keras internal tfpipe relies on, each with why; tests/unit/compat/test_keras.py pins them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf
from keras.src import backend as _keras_backend
from keras.src.backend.tensorflow import core as _tf_backend


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


# The optimizer methods tfpipe replaces on an instance (tfpipe/training.py), each pinned by a test:
# ``_distributed_tf_update_step(distribution, grads_and_vars, learning_rate)`` is the TensorFlow backend's
# loop over every variable's ``update_step`` (private).
OPTIMIZER_HOOKS = ("add_variable_from_reference", "update_step", "check_finite", "_distributed_tf_update_step")


def wrap_optimizer_method(
    optimizer: keras.optimizers.Optimizer, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Replace the method ``name`` (one of ``OPTIMIZER_HOOKS``) on this instance alone by ``wrap(the method)``.

    tfpipe creates each slot (``add_variable_from_reference``) and runs each update
    (``update_step``) on its variable's device, and makes a LossScaleOptimizer's finite
    check (``check_finite``) read sparse gradients' values. Keras' ``build`` and
    ``apply_gradients`` call them through ``self``, so an instance attribute replaces them;
    a method Keras no longer has fails here instead of leaving the optimizer unpatched.
    """
    method = getattr(optimizer, name, None)
    if name not in OPTIMIZER_HOOKS or not callable(method):
        raise AttributeError(
            f"{type(optimizer).__name__} has no method {name!r} for tfpipe to wrap (Keras renamed it?)"
        )
    setattr(optimizer, name, wrap(method))


def patched(optimizer: keras.optimizers.Optimizer, what: str) -> bool:
    """Whether ``mark_patched(optimizer, what)`` was called: a second patch would wrap the first."""
    return getattr(optimizer, f"_tfpipe_{what}", False)


def mark_patched(optimizer: keras.optimizers.Optimizer, what: str) -> None:
    """Mark ``optimizer`` as patched for ``what`` (an attribute of tfpipe's own on Keras' object)."""
    setattr(optimizer, f"_tfpipe_{what}", True)


def backing_variable(variable: keras.Variable) -> Any:
    """The tf.Variable inside a Keras variable: what Keras' TF optimizers hand ``update_step`` (None while deferred)."""
    return variable._value  # noqa: SLF001


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


def takes_training(operation: Any) -> bool:
    """Whether a Functional model's call passes its ``training`` argument on to the node ``operation``.

    Keras passes a call-context argument only to operations that list it in ``_call_context_args``
    (layers do, ``keras.ops`` operations do not); tfpipe runs a Functional model's nodes itself.
    """
    return "training" in getattr(operation, "_call_context_args", ())


# What Keras' fit, evaluate and predict batch arrays by when batch_size is None (its array data adapter)
DEFAULT_BATCH_SIZE = 32

# What Keras hangs on a tensor: its mask (layers read it) and, on a softmax or sigmoid output, its logits
# (Keras' cross-entropy reads them instead, for exactness). A function boundary or a cut drops both;
# tfpipe carries them across as tensors of their own and hangs them back (``hung``, ``hang``).
MASK = "_keras_mask"
LOGITS = "_keras_logits"


def hung(x: Any, attribute: str) -> Any:
    """What Keras hung on the tensor ``x`` under ``attribute`` (``MASK`` or ``LOGITS``), or None."""
    return getattr(x, attribute, None)


def hang(x: Any, attribute: str, value: Any) -> None:
    """Hang ``value`` on the tensor ``x`` under ``attribute`` (``MASK`` or ``LOGITS``), as Keras' backend does."""
    setattr(x, attribute, value)


def move_variable(variable: keras.Variable, device: str) -> None:
    """Re-create the TensorFlow variable behind a Keras variable on ``device``, with its value.

    Keras creates a variable where its layer is built and has no public way to move it;
    the TensorFlow backend keeps the tf.Variable in ``_value`` and makes it in ``_initialize``.
    """
    old = variable._value  # noqa: SLF001
    with tf.init_scope(), tf.device(device):
        variable._initialize(tf.identity(old.read_value()))  # noqa: SLF001


def remake_variable(variable: keras.Variable, device: str, value: tf.Tensor) -> None:
    """Make the TensorFlow variable behind a Keras variable anew on ``device``, holding ``value``.

    For a variable whose worker process died: its old handle points at nothing. As
    ``move_variable``, through the TensorFlow backend's ``_initialize``.
    """
    with tf.init_scope(), tf.device(device):
        variable._initialize(value)  # noqa: SLF001


# The TensorFlow backend's Variable makes its tf.Variable from an initializer in ``_initialize_with_initializer``
# (Keras' own deferred variables, made in a StatelessScope, go through it too when initialized); kept unpatched here.
_MAKE_FROM_INITIALIZER = _tf_backend.Variable._initialize_with_initializer  # noqa: SLF001
_LOAD_WEIGHTS = keras.Model.load_weights


@contextlib.contextmanager
def deferring_variables(
    on_variable: Callable[[keras.Variable], None], on_load: Callable[[keras.Model, tuple, dict], None]
) -> Iterator[None]:
    """While open, a variable made from an initializer keeps the initializer and no value, and ``Model.load_weights``
    is recorded instead of run; ``on_variable`` and ``on_load`` receive each. Assigning such a variable meanwhile
    is a ValueError that says when it can be.

    Keras' own way to defer (a ``StatelessScope``) refuses a variable made from a value (an optimizer's step counter,
    which a keras_hub task makes in ``compile``) and turns assignments into recorded updates; and it initializes
    every deferred variable on the current device when the outermost scope closes. Here only variables made
    from an initializer wait, kept out of Keras' list, until ``make_deferred`` gives each its device.
    """

    def defer(variable: keras.Variable, initializer: Any) -> None:
        variable._value = None  # noqa: SLF001
        variable._initializer = initializer  # noqa: SLF001
        on_variable(variable)

    def record(model: keras.Model, *args: Any, **kwargs: Any) -> None:
        on_load(model, args, kwargs)

    def assign(variable: keras.Variable, value: Any) -> None:
        if variable._value is None:  # noqa: SLF001
            raise ValueError(
                f"Variable {variable.path!r} was made under tfpipe.deferred_weights() and has no value to assign "
                "until PipelineModel makes it on its cell's device: assign after that (Model.load_weights in the "
                "block waits by itself; a keras_hub preset converted from another format must first be saved as a "
                "Keras preset with save_to_preset)."
            )
        assigned(variable, value)

    variable_class = _tf_backend.Variable
    names = ("_initialize_with_initializer", "_direct_assign")
    made, assigned = (getattr(variable_class, name) for name in names)
    loads = keras.Model.load_weights
    variable_class._initialize_with_initializer, variable_class._direct_assign = defer, assign  # noqa: SLF001
    keras.Model.load_weights = record
    try:
        yield
    finally:
        variable_class._initialize_with_initializer, variable_class._direct_assign = made, assigned  # noqa: SLF001
        keras.Model.load_weights = loads


def is_deferred(variable: keras.Variable) -> bool:
    """Whether ``variable`` has no value yet: made under ``deferring_variables`` (or Keras' StatelessScope)."""
    return variable._value is None and variable._initializer is not None  # noqa: SLF001


def make_deferred(variable: keras.Variable, device: str | None) -> None:
    """Give a deferred variable its value from its initializer, computed and held on ``device`` (None: the current)."""
    with tf.init_scope(), tf.device(device) if device is not None else contextlib.nullcontext():
        _MAKE_FROM_INITIALIZER(variable, variable._initializer)  # noqa: SLF001
    variable._initializer = None  # noqa: SLF001


def release(variable: keras.Variable) -> None:
    """Let ``variable``'s value go (its memory freed once nothing else holds it); the variable is not used again."""
    variable._value = None  # noqa: SLF001


def load_weights(model: keras.Model, *args: Any, **kwargs: Any) -> None:
    """``model.load_weights`` as Keras defines it, also while ``deferring_variables`` records the calls."""
    _LOAD_WEIGHTS(model, *args, **kwargs)


def clone_uncompiled(model: keras.Model) -> keras.Model:
    """``keras.models.clone_model(model)`` without compiling the clone.

    ``clone_model`` compiles the clone as ``model`` was (a keras_hub task compiles itself when made), and compiling
    builds the optimizer over the clone's weights, which a clone made under ``deferring_variables`` does not have
    yet. ``compiled`` is the plain attribute Keras' ``Trainer`` reads for it.
    """
    compiled = model.compiled
    model.compiled = False
    try:
        return keras.models.clone_model(model)
    finally:
        model.compiled = compiled


# BackupAndRestore keeps its files' paths and its epoch count privately; "tfpipe_batches_done" is tfpipe's own
# key in the metadata, which Keras reads only the "epoch" of.
BATCHES_DONE = "tfpipe_batches_done"


def _metadata(callback: keras.callbacks.BackupAndRestore) -> dict[str, Any]:
    path = callback._training_metadata_path  # noqa: SLF001
    if not tf.io.gfile.exists(path):
        return {}
    with tf.io.gfile.GFile(path) as f:
        return json.loads(f.read())


def has_backup(callback: keras.callbacks.BackupAndRestore) -> bool:
    """Whether a BackupAndRestore callback's directory holds a backup to restore."""
    return tf.io.gfile.exists(callback._weights_path)  # noqa: SLF001


def backup_point(callback: keras.callbacks.BackupAndRestore) -> tuple[int, int]:
    """(epoch, batches of it trained on) where the callback's backup resumes; (0, 0) without one.

    Keras' own saves inside an epoch (``save_freq=<int>``) record the index of the last batch.
    """
    meta = _metadata(callback)
    if not meta:
        return 0, 0
    if BATCHES_DONE in meta:
        return int(meta["epoch"]), int(meta[BATCHES_DONE])
    inside = isinstance(callback.save_freq, int) and not isinstance(callback.save_freq, bool)
    return int(meta["epoch"]), int(meta.get("batch", 0)) + 1 if inside else 0


def save_backup(callback: keras.callbacks.BackupAndRestore, epoch: int, batches_done: int) -> None:
    """Write the callback's backup now (Keras' ``_save_model``), as of ``batches_done`` batches into ``epoch``."""
    callback._current_epoch = epoch  # noqa: SLF001
    callback._save_model()  # noqa: SLF001
    meta = {"epoch": epoch, "batch": max(batches_done - 1, 0), BATCHES_DONE: batches_done}
    with tf.io.gfile.GFile(callback._training_metadata_path, "w") as f:  # noqa: SLF001
        f.write(json.dumps(meta))


def set_backup_epoch(callback: keras.callbacks.BackupAndRestore, epoch: int) -> None:
    """Tell the callback which epoch runs: after a restore it still counts from 0, and saves would say so."""
    callback._current_epoch = epoch  # noqa: SLF001


def optimizer_key(optimizer: keras.optimizers.Optimizer, variable: keras.Variable) -> Any:
    """The key a Keras optimizer knows ``variable`` by (the TensorFlow backend's is the tf.Variable's id)."""
    return optimizer._var_key(variable)  # noqa: SLF001


def rekey_optimizer(optimizer: keras.optimizers.Optimizer, new_keys: dict[Any, Any]) -> None:
    """Point the optimizer's per-variable tables from old keys to new ones (variables made anew, ``remake_variable``).

    Keras keys them by the tf.Variable behind each Keras variable, which a remade variable replaces.
    """
    for inner in (optimizer, getattr(optimizer, "inner_optimizer", None)):  # a LossScaleOptimizer's too
        if inner is None:
            continue
        for name in ("_trainable_variables_indices", "_exclude_from_weight_decay_cache"):
            table = getattr(inner, name, None)
            if isinstance(table, dict):
                setattr(inner, name, {new_keys.get(k, k): v for k, v in table.items()})
        excluded = getattr(inner, "_exclude_from_weight_decay", None)
        if isinstance(excluded, set):
            inner._exclude_from_weight_decay = {new_keys.get(k, k) for k in excluded}  # noqa: SLF001


@contextlib.contextmanager
def name_scopes_restored() -> Iterator[None]:
    """Keras' stack of name scopes as it was on entry, also after an error.

    In a graph, Keras' ``name_scope`` pushes itself onto its global stack before TensorFlow's
    ``name_scope`` checks the name; a name TensorFlow refuses at the root (a layer named
    ``__adds_loss``) raises with the entry pushed, and every variable made later in the process
    has that name in its path.
    """
    from keras.src.backend.common import global_state

    before = list(global_state.get_global_attribute("name_scope_stack") or [])
    try:
        yield
    finally:
        stack = global_state.get_global_attribute("name_scope_stack")
        if stack is not None and len(stack) > len(before):
            del stack[len(before) :]
