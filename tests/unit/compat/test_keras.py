"""Every private Keras internal in tfpipe/_compat/keras.py still exists and behaves as tfpipe expects.

If one of these fails after upgrading Keras, the internal it names changed:
fix tfpipe/_compat/keras.py, do not loosen the test.
"""

import gc
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import _compat


def test_in_stateless_scope():
    assert not _compat.in_stateless_scope()
    with keras.StatelessScope():
        assert _compat.in_stateless_scope()


def _compiled_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


def test_compiled_loss_is_the_compiled_loss_without_model_losses():
    model = _compiled_model()
    y, y_pred = np.ones((4, 2), "float32"), np.zeros((4, 2), "float32")
    assert float(_compat.compiled_loss(model)(y, y_pred, None)) == pytest.approx(1.0)
    unlossed = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    unlossed.compile(optimizer="sgd")
    assert _compat.compiled_loss(unlossed) is None


def test_loss_tracker_reports_fits_loss():
    model = _compiled_model()
    tracker = _compat.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean) and tracker.name == "loss"
    assert tracker in model.metrics


def test_symbolic_build_creates_metric_and_optimizer_variables():
    model = _compiled_model()
    batch = (keras.KerasTensor((None, 3)), keras.KerasTensor((None, 2)), None)
    assert not model.optimizer.built
    before = len(model.metrics_variables)
    _compat.symbolic_build(model, batch)
    assert model.optimizer.built and len(model.metrics_variables) > before


def test_gradient_all_reduce_is_called_before_every_update_and_can_be_replaced():
    optimizer = keras.optimizers.SGD(0.5)
    variable = keras.Variable(np.ones(2, "float32"))
    optimizer.build([variable])
    reduce, seen = _compat.gradient_all_reduce(optimizer), []

    def doubled(grads_and_vars):
        seen.append(len(grads_and_vars))
        return [(2.0 * g, v) for g, v in reduce(grads_and_vars)]

    _compat.set_gradient_all_reduce(optimizer, doubled)
    optimizer.apply_gradients([(tf.ones(2), variable)])
    assert seen == [1]
    np.testing.assert_allclose(variable.numpy(), [0.0, 0.0])  # 1 - 0.5 * (2 * 1)


def test_step_counter_as_is_what_an_update_reads_and_is_restored():
    optimizer = keras.optimizers.Adam(0.1)
    variable = keras.Variable(np.ones(2, "float32"))
    optimizer.build([variable])
    counter = _compat.step_counter(optimizer)
    assert counter is optimizer.iterations  # no gradient accumulation
    with _compat.step_counter_as(optimizer, tf.constant(9, counter.dtype)):  # Adam's bias correction at step 10
        optimizer.update_step(tf.ones(2), variable, 0.1)
    assert _compat.step_counter(optimizer) is counter
    m, v = 0.1, 0.001  # after one update from zero slots with gradient 1
    alpha = 0.1 * np.sqrt(1 - 0.999**10) / (1 - 0.9**10)
    np.testing.assert_allclose(variable.numpy(), 1 - m * alpha / (np.sqrt(v) + 1e-7), rtol=1e-5)  # step 1: 1 - 0.1


def test_the_backing_variable_is_what_keras_hands_update_step():
    optimizer = keras.optimizers.SGD(0.1)
    variable = keras.Variable(np.ones(2, "float32"))
    handed = []
    _compat.wrap_optimizer_method(optimizer, "update_step", lambda update: lambda g, v, lr: handed.append(v))
    optimizer.apply_gradients([(tf.ones(2), variable)])
    assert handed == [_compat.backing_variable(variable)] and isinstance(handed[0], tf.Variable)


def test_flatten_layers_reaches_nested_layers():
    inner = keras.Sequential([keras.layers.Dense(2, name="deep")])
    outer = keras.Sequential([keras.Input((3,)), inner])
    names = [layer.name for layer in _compat.flatten_layers(outer)]
    assert names[0] == outer.name and inner.name in names and "deep" in names


def test_functional_execution_order_is_by_depth_without_input_nodes():
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(3, name="d")
    outputs = keras.layers.Add(name="add")([dense(inputs), inputs])
    model = keras.Model(inputs, outputs)
    nodes = _compat.execution_order(model)
    assert [n.operation.name for n in nodes] == ["d", "add"]
    assert list(nodes[1].arguments.keras_tensors)[1] is inputs


def test_wrapped_optimizer_methods_are_what_build_and_apply_gradients_call():
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.1))
    inner, calls = optimizer.inner_optimizer, []

    def recorded(name):
        def wrap(method):
            def call(*args, **kwargs):
                calls.append(name)
                return method(*args, **kwargs)

            return call

        return wrap

    hooks = [(inner, "add_variable_from_reference"), (inner, "update_step"), (optimizer, "check_finite")]
    for opt, name in [*hooks, (inner, "_distributed_tf_update_step")]:
        _compat.wrap_optimizer_method(opt, name, recorded(name))
    assert type(inner).update_step is keras.optimizers.Adam.update_step  # the instance alone
    variables = [keras.Variable(np.ones(2, "float32")), keras.Variable(np.ones(3, "float32"))]
    optimizer.build(variables)
    assert calls == ["add_variable_from_reference"] * 4  # Adam's two slots per variable
    calls.clear()
    optimizer.apply_gradients([(tf.ones(2), variables[0]), (tf.ones(3), variables[1])])
    # every variable's update in one call of the loop over them (run per device: tfpipe/distributed/grouped.py)
    assert calls == ["check_finite", "_distributed_tf_update_step", "update_step", "update_step"]
    assert float(variables[0].numpy()[0]) < 1.0  # the wrapped update applied
    with pytest.raises(AttributeError, match="no method 'apply_step'"):
        _compat.wrap_optimizer_method(inner, "apply_step", recorded("x"))
    with pytest.raises(AttributeError, match="check_finite"):
        _compat.wrap_optimizer_method(inner, "check_finite", recorded("x"))  # only a LossScaleOptimizer has it


def test_patched_marks_an_optimizer_once():
    optimizer = keras.optimizers.SGD()
    assert not _compat.patched(optimizer, "placed")
    _compat.mark_patched(optimizer, "placed")
    assert _compat.patched(optimizer, "placed") and not _compat.patched(optimizer, "slices")


def test_takes_training_is_what_a_functional_call_passes_training_to():
    seen = {}

    class Op(keras.Operation):
        def call(self, x, training=None):
            seen[type(self).__name__] = training
            return x

        def compute_output_spec(self, x, training=None):
            return keras.KerasTensor(x.shape, x.dtype)

    class Layer(keras.layers.Layer):
        def call(self, x, training=None):
            seen[type(self).__name__] = training
            return x

    inputs = keras.Input((2,))
    operation, layer = Op(), Layer()
    model = keras.Model(inputs, layer(operation(inputs)))
    model(np.ones((1, 2), "float32"), training=True)
    assert seen == {"Op": None, "Layer": True}
    assert (_compat.takes_training(operation), _compat.takes_training(layer)) == (False, True)


def test_keras_hangs_a_mask_where_hung_finds_it_and_its_layers_read_one_hung_there():
    tokens = keras.Input((3,), dtype="int32")
    embedded = keras.layers.Embedding(5, 2, mask_zero=True)(tokens)
    assert _compat.hung(embedded, _compat.MASK) is not None  # symbolic: what tfpipe.partition.functional reads

    @tf.function(autograph=False)
    def pooled(x, mask):
        _compat.hang(x, _compat.MASK, mask)
        return keras.layers.GlobalAveragePooling1D()(x)

    x = tf.constant([[[1.0], [2.0], [6.0]]])
    assert float(pooled(x, tf.constant([[True, True, False]]))[0, 0]) == pytest.approx(1.5)  # 6.0 masked out


def test_keras_hangs_logits_where_hung_finds_them_and_its_cross_entropy_reads_them():
    z, y = tf.constant([[2.0, -1.0, 0.5]]), tf.constant([[0.0, 1.0, 0.0]])

    @tf.function(autograph=False)
    def losses(z):
        probs, elsewhere = keras.activations.softmax(z), tf.fill(tf.shape(z), 1.0 / 3.0)
        assert _compat.hung(probs, _compat.LOGITS) is z
        assert _compat.hung(keras.activations.sigmoid(z), _compat.LOGITS) is z
        _compat.hang(elsewhere, _compat.LOGITS, z)  # what the probabilities say is ignored: the logits count
        return keras.losses.categorical_crossentropy(y, elsewhere), keras.losses.categorical_crossentropy(
            y, z, from_logits=True
        )

    hung, from_logits = losses(z)
    np.testing.assert_allclose(hung.numpy(), from_logits.numpy(), rtol=1e-6)


def test_runs_as_functional_unless_a_subclass_overrides_call():
    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(2)(inputs)

    class Task(keras.Model):  # as keras_hub's backbones and tasks: a Functional model by its constructor
        pass

    class Overriding(keras.Model):
        def call(self, x):
            return x

    assert _compat.runs_as_functional(keras.Model(inputs, outputs))
    assert _compat.runs_as_functional(Task(inputs, outputs))
    assert not _compat.runs_as_functional(Overriding(inputs, outputs))


def test_move_variable_recreates_it_on_the_device_with_its_value():
    layer = keras.layers.Dense(2)
    with tf.device("/CPU:0"):
        layer.build((None, 3))
    kernel = layer.kernel
    kernel.assign(np.full((3, 2), 2.0, "float32"))
    _compat.move_variable(kernel, "/CPU:1")
    assert kernel.value.device.endswith("/device:CPU:1") and layer.kernel is kernel
    np.testing.assert_array_equal(kernel.numpy(), np.full((3, 2), 2.0))
    kernel.assign_add(np.ones((3, 2), "float32"))  # still the layer's variable, assignable where it now is
    np.testing.assert_array_equal(layer(np.ones((1, 3), "float32")).numpy(), [[9.0, 9.0]])


def test_deferring_variables_keeps_the_initializer_and_records_loads_until_made_on_a_device():
    made, loads = [], []
    with _compat.deferring_variables(made.append, lambda *call: loads.append(call)):
        layer = keras.layers.Dense(2, kernel_initializer="ones")
        layer.build((None, 3))
        counter = keras.Variable(0, dtype="int64")  # made from a value, as an optimizer's step counter: not deferred
        model = keras.Sequential([keras.Input((3,)), layer])
        model.load_weights("somewhere.weights.h5", skip_mismatch=True)
    assert [id(v) for v in made] == [id(layer.kernel), id(layer.bias)]
    assert all(_compat.is_deferred(v) for v in made) and not _compat.is_deferred(counter)
    assert loads == [(model, ("somewhere.weights.h5",), {"skip_mismatch": True})]
    assert layer.kernel.value.shape == (3, 2)  # unmade, a variable reads as its initial value (Keras' placeholder)
    with _compat.deferring_variables(made.append, loads.append):
        with pytest.raises(ValueError, match="has no value to assign until PipelineModel makes it"):
            layer.bias.assign(np.ones(2, "float32"))  # as a converting preset loader does
        counter.assign(3)  # a variable made from a value assigns as usual
    _compat.make_deferred(layer.kernel, "/CPU:1")
    assert layer.kernel.value.device.endswith("CPU:1") and not _compat.is_deferred(layer.kernel)
    np.testing.assert_array_equal(layer.kernel.numpy(), np.ones((3, 2)))
    fresh = keras.layers.Dense(2)  # outside the block Keras makes variables as usual again
    fresh.build((None, 3))
    assert not _compat.is_deferred(fresh.kernel)


def test_release_lets_a_variables_tensorflow_variable_go():
    import weakref

    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    backing = weakref.ref(layer.kernel.value)
    _compat.release(layer.kernel)
    gc.collect()
    assert backing() is None  # nothing else held it: its memory went with it


def test_clone_uncompiled_clones_a_compiled_model_without_building_an_optimizer_over_its_weights():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="adam", loss="mse")
    assert keras.models.clone_model(model).compiled  # what clone_uncompiled avoids: the clone's optimizer built
    with _compat.deferring_variables(lambda v: None, lambda *a: None):
        clone = _compat.clone_uncompiled(model)
    assert not clone.compiled and model.compiled  # the model's own flag restored
    assert [v.shape for v in clone.weights] == [v.shape for v in model.weights]
    assert all(_compat.is_deferred(v) for v in clone.weights)


def test_remake_variable_gives_it_a_new_tensorflow_variable_that_its_optimizer_is_rekeyed_to():
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    optimizer = keras.optimizers.SGD(0.5)
    optimizer.build(layer.trainable_variables)
    old = _compat.optimizer_key(optimizer, layer.kernel)
    before = layer.kernel.value
    _compat.remake_variable(layer.kernel, "/CPU:0", tf.ones((3, 2)))
    assert layer.kernel.value is not before and layer.kernel.value.device.endswith("/device:CPU:0")
    np.testing.assert_array_equal(layer.kernel.numpy(), np.ones((3, 2)))
    new = _compat.optimizer_key(optimizer, layer.kernel)
    assert new != old
    with pytest.raises(ValueError, match="Unknown variable"):  # Keras knows variables by their tf.Variable
        optimizer.apply_gradients([(tf.ones((3, 2)), layer.kernel)])
    _compat.rekey_optimizer(optimizer, {old: new})
    optimizer.apply_gradients([(tf.ones((3, 2)), layer.kernel)])
    np.testing.assert_array_equal(layer.kernel.numpy(), np.full((3, 2), 0.5))


def test_backups_as_backup_and_restore_reads_and_writes_them(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    callback = keras.callbacks.BackupAndRestore(str(tmp_path / "b"), save_freq=2)
    callback.set_model(model)
    assert not _compat.has_backup(callback) and _compat.backup_point(callback) == (0, 0)
    _compat.save_backup(callback, epoch=3, batches_done=5)
    assert _compat.has_backup(callback) and _compat.backup_point(callback) == (3, 5)
    callback.on_train_begin()  # Keras' own restore reads the epoch
    assert model._initial_epoch == 3
    _compat.set_backup_epoch(callback, 4)
    callback.on_train_batch_end(0)
    callback.on_train_batch_end(1)  # Keras' own save inside an epoch (save_freq=2): the epoch set, the last index
    assert json.loads((tmp_path / "b" / "training_metadata.json").read_text()) == {"epoch": 4, "batch": 1}
    assert _compat.backup_point(callback) == (4, 2)
    callback.save_freq = "epoch"  # an epoch's save resumes at the next epoch's start
    callback.on_epoch_end(4)
    assert _compat.backup_point(callback) == (5, 0)


def test_a_name_scope_tensorflow_refuses_leaves_keras_stack_open_unless_restored():
    def refused():
        with keras.name_scope("__refused"):  # a root name TensorFlow refuses in a graph
            pass

    @tf.function
    def leaks():
        with pytest.raises(ValueError, match="not a valid root scope name"):
            refused()
        return tf.constant(0)

    @tf.function
    def restored():
        with pytest.raises(ValueError, match="not a valid root scope name"), _compat.name_scopes_restored():
            refused()
        return tf.constant(0)

    restored()
    assert keras.Variable(1.0, name="after_restored").path == "after_restored"
    leaks()  # Keras' own behaviour: what the guard is for (if this stops leaking, the guard can go)
    try:
        assert keras.Variable(1.0, name="after_leak").path == "__refused/after_leak"
    finally:  # the leaked entry must not reach the tests after this one
        from keras.src.backend.common import global_state

        global_state.get_global_attribute("name_scope_stack").clear()


def test_keras_batches_arrays_by_its_default_batch_size():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    n = 2 * _compat.DEFAULT_BATCH_SIZE + 1
    model.fit(np.ones((n, 2), "float32"), np.ones((n, 1), "float32"), epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 3  # two full batches and one of a sample
