"""Functional models enter PipelineModel: skips go straight to their readers, and training equals the model's own."""

import functools
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.util import cpu_devices, max_rel_error, small_unet
from tfpipe import _compat
from tfpipe.partition import functional


def _two_inputs():
    """A residual net with two inputs, the second read only at the end; a keras.ops call and a nested model."""
    keras.utils.set_random_seed(4)
    inner_in = keras.Input((8,))
    inner = keras.Model(inner_in, keras.layers.Dense(8, activation="tanh", name="inner_dense")(inner_in), name="block")
    a, b = keras.Input((6,), name="a"), keras.Input((3,), name="b")
    h = keras.layers.Dense(8, activation="tanh", name="d0")(a)
    h2 = inner(h)
    h = keras.layers.Add(name="residual")([h, h2])
    h = keras.layers.Dense(8, activation="tanh", name="d1")(h)
    h = keras.ops.tanh(keras.layers.Concatenate(name="late_input")([h, b]))
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(2, name="out")(h), name="two_inputs")


def _data(model, n, seed=0):
    rng = np.random.default_rng(seed)

    def make(spec):
        return rng.standard_normal((n,) + tuple(spec.shape[1:])).astype("float32")

    x = keras.tree.map_structure(make, model.input)
    y = keras.tree.map_structure(make, model.output)
    return x, y


def _fit_both(make, k, m, n, balance=None, compile_args=None, epochs=2):
    """Fit the model and a PipelineModel of an identical copy; return both and the pipelined one's history."""
    reference, own = make(), make()
    split = {"balance": balance} if balance else {"num_partitions": k}
    model = tfpipe.PipelineModel(own, devices=cpu_devices(k), num_micro_batches=m, **split)
    x, y = _data(reference, n)
    histories = []
    for net in (reference, model):
        net.compile(**(compile_args or {"optimizer": "sgd", "loss": "mse"}))
        histories.append(net.fit(x, y, batch_size=n, epochs=epochs, shuffle=False, verbose=0).history)
    return reference, model, x, histories


@pytest.mark.parametrize("k", [2, 4])
def test_unet_with_skips_across_every_cell_trains_like_the_model(k):
    balance = [6, 6] if k == 2 else [3, 3, 3, 3]  # 12 nodes; at K=4 the first skip goes from cell 0 to 3
    reference, model, x, _ = _fit_both(small_unet, k, m=3, n=7, balance=balance)  # 7 = 3 + 2 + 2: uneven
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    routes = model._pipeline.routes  # noqa: SLF001 - where each skip goes
    last = k - 1
    assert 0 in [p for p, _ in routes.feeds[last]], "the first skip goes from cell 0 straight to the last cell"
    for middle in range(1, last):  # ... and not through the cells in between
        skip = {pos for p, pos in routes.feeds[last] if p == 0}
        assert not skip & {pos for p, pos in routes.feeds[middle] if p == 0}


@pytest.mark.parametrize("k", [2, 4])
def test_two_inputs_one_read_deep_with_an_op_and_a_nested_model_trains_like_the_model(k):
    reference, model, x, _ = _fit_both(_two_inputs, k, m=3, n=8)
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    names = [node.name for node in model._graph.nodes]  # noqa: SLF001
    assert "inner_dense" in names and "block" not in names  # the nested model is flattened into the graph
    assert "block" in [layer.name for layer in model.pipeline_layers]  # but its weights stay the model's own
    assert any(
        isinstance(n.operation, keras.Operation) and not isinstance(n.operation, keras.layers.Layer)
        for n in model._graph.nodes
    )  # noqa: SLF001 - keras.ops.tanh is a node of its own


def _two_outputs(as_list=False):
    keras.utils.set_random_seed(5)
    x = keras.Input((5,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="h")(x)
    early = keras.layers.Dense(1, name="early")(h)
    h = keras.layers.Dense(8, activation="relu", name="h2")(h)
    late = keras.layers.Dense(3, activation="softmax", name="late")(h)
    return keras.Model(x, [early, late] if as_list else {"early": early, "late": late})


@pytest.mark.parametrize("as_list", [False, True])  # a list: compile matches the dicts by the output layers' names
def test_several_outputs_with_their_own_losses_weights_and_metrics(as_list):
    args = {
        "optimizer": "sgd",
        "loss": {"early": "mse", "late": "categorical_crossentropy"},
        "loss_weights": {"early": 0.5, "late": 2.0},
        "metrics": {"early": ["mae"], "late": ["categorical_accuracy"]},
    }
    make = functools.partial(_two_outputs, as_list)
    reference, model, _, (ref_history, history) = _fit_both(make, 2, m=2, n=6, compile_args=args)
    assert model.output_names == ["early", "late"]
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5
    assert sorted(history) == sorted(ref_history)
    for name, values in ref_history.items():
        np.testing.assert_allclose(history[name], values, rtol=1e-5, err_msg=name)


def _bn_softmax():
    keras.utils.set_random_seed(6)
    x = inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    skip = x
    x = keras.layers.Conv2D(4, 3, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.GlobalAveragePooling2D()(keras.layers.Add()([x, skip]))
    return keras.Model(inputs, keras.layers.Dense(5, activation="softmax")(x))


def test_softmax_outputs_keep_their_logits_across_the_cut_so_the_loss_is_exact():
    # Keras' cross-entropy of a softmax output reads the logits hung on it; saturated probabilities
    # (BatchNorm makes them so here) would otherwise be clipped and give other gradients.
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((4, 8, 8, 3)).astype("float32"), rng.integers(0, 5, 4)
    reference, own = _bn_softmax(), _bn_softmax()
    model = tfpipe.PipelineModel(own, balance=[2, 5], devices=cpu_devices(2))
    for net in (reference, model):
        net.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        net.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5


def test_keras_applications_vgg16_enters():
    vgg = keras.applications.VGG16(weights=None, input_shape=(32, 32, 3), classes=10)
    model = tfpipe.PipelineModel(vgg, balance=[11, 11], devices=cpu_devices(2))
    assert len(model.pipeline_layers) == 22 and model.pipeline_layers[-1].name == "predictions"


def _shared_twice():
    keras.utils.set_random_seed(7)
    dense = keras.layers.Dense(4, activation="tanh", name="twice")
    x = inputs = keras.Input((4,))
    x = keras.layers.Dense(4, name="first")(x)
    x = dense(dense(x))
    return keras.Model(inputs, keras.layers.Dense(2, name="last")(x))


def test_the_weights_move_to_their_cells_devices():
    own = _two_inputs()
    model = tfpipe.PipelineModel(own, balance=[3, 4], devices=cpu_devices(2))
    for cell in model.cells:
        assert cell.trainable_variables
        assert all(v.value.device.endswith(f"CPU:{cell.index}") for v in cell.trainable_variables)
    x, _ = _data(own, 2)
    np.testing.assert_allclose(own.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)  # still shared


def test_a_layer_called_twice_trains_within_one_cell():
    reference, model, _, _ = _fit_both(_shared_twice, 2, m=2, n=4, balance=[1, 3])
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5


def test_a_layer_called_in_two_cells_trains_like_the_model():  # its weights live in cell 0 (test_tied.py)
    reference, model, _, _ = _fit_both(_shared_twice, 2, m=2, n=4, balance=[2, 2])
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5
    assert [layer.name for layer in model.cells[1].layers][0] == "twice"


def test_a_node_that_is_not_a_keras_operation_is_refused_naming_it(monkeypatch):
    model = _shared_twice()
    nodes = list(_compat.execution_order(model))
    nodes[1] = types.SimpleNamespace(operation=np.tanh, arguments=nodes[1].arguments, outputs=nodes[1].outputs)
    monkeypatch.setattr(_compat, "execution_order", lambda m: nodes if m is model else [])
    with pytest.raises(
        ValueError, match=r"The node ufunc <ufunc 'tanh'> of .* is not a Keras layer or operation.*Layer"
    ):
        tfpipe.PipelineModel(model, num_partitions=2, devices=cpu_devices(2))


def test_balance_counts_nodes():
    with pytest.raises(ValueError, match=r"sums to 3 but there are 4 nodes \(layer and keras.ops calls\)"):
        tfpipe.PipelineModel(_shared_twice(), balance=[2, 1], devices=cpu_devices(2))


def test_weights_files_and_saved_models_round_trip_with_the_original(tmp_path):
    original = _two_inputs()
    x, _ = _data(original, 4)
    model = tfpipe.PipelineModel(_two_inputs(), num_partitions=2, devices=cpu_devices(2))
    path = str(tmp_path / "original.weights.h5")
    original.save_weights(path)
    model.load_weights(path)
    assert max_rel_error(model.get_weights(), original.get_weights()) == 0
    model.set_weights([w + 1.0 for w in model.get_weights()])
    model.save_weights(str(tmp_path / "pipelined.weights.h5"))
    original.load_weights(str(tmp_path / "pipelined.weights.h5"))
    assert max_rel_error(model.get_weights(), original.get_weights()) == 0
    model.compile(optimizer="sgd", loss="mse")
    model.save(str(tmp_path / "model.keras"))
    loaded = keras.models.load_model(str(tmp_path / "model.keras"))
    assert isinstance(loaded, tfpipe.PipelineModel) and loaded.balance == model.balance
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)


def test_to_functional_gives_the_graph_back():
    own = _two_inputs()
    model = tfpipe.PipelineModel(own, num_partitions=2, devices=cpu_devices(2))
    assert model.to_functional() is own
    x, _ = _data(own, 3)
    copy = model.to_functional(copy=True)
    assert copy is not own
    np.testing.assert_allclose(copy.predict(x, verbose=0), own.predict(x, verbose=0), rtol=1e-6)
    with pytest.raises(TypeError, match="to_functional"):
        model.to_sequential()
    with pytest.raises(TypeError, match="layer sequence.*to_sequential"):
        tfpipe.PipelineModel([keras.layers.Dense(2)], num_partitions=1).to_functional()


def test_summary_lists_the_tensors_crossing_each_cut():
    model = tfpipe.PipelineModel(small_unet(), balance=[3, 3, 3, 3], devices=cpu_devices(4))
    lines = []
    model.summary(print_fn=lines.append)
    cuts = [line for line in lines if line.startswith("Cut ")]
    assert len(cuts) == 3
    # After cell 0: the first skip (16x16x4 floats, 4.1 kB per sample) and the second (8x8x8, also read in cell 2).
    assert cuts[0].startswith("Cut 0|1: 2 tensors, 6.14 kB/sample") and "down0_conv0 [16, 16, 4] 4.1 kB" in cuts[0]
    assert "[16, 16, 4]" in cuts[2]  # the first skip still crosses the last cut, to the cell that reads it


def test_crossing_bytes_feed_the_balance():
    graph = functional.Graph(small_unet())
    live = graph.live_bytes()
    assert len(live) == len(graph.nodes) and min(live) > 0
    # The first skip (16x16x4 float32) is live across every cut until the concatenation that reads it.
    concat = next(i for i, n in enumerate(graph.nodes) if n.name == "up0_concat")
    assert all(b >= 16 * 16 * 4 * 4 for b in live[:concat])


def test_balance_functions_count_the_nodes_of_a_functional_model():
    x, _ = _data(small_unet(), 4)
    split, costs = tfpipe.balance.by_flops(small_unet(), 3, x, return_costs=True)
    assert len(costs) == 12 and sum(split) == 12
    assert split == tfpipe.PipelineModel(small_unet(), num_partitions=3, devices=cpu_devices(3)).balance
    assert sum(tfpipe.balance.by_params(small_unet(), 2)) == 12


def test_unroll_false_falls_back_to_unrolled_for_a_graph_with_skips():
    reference, own = small_unet(), small_unet()
    model = tfpipe.PipelineModel(own, balance=[6, 6], devices=cpu_devices(2), num_micro_batches=2, unroll=False)
    x, y = _data(reference, 4)
    reference.compile(optimizer="sgd", loss="mse")
    model.compile(optimizer="sgd", loss="mse")
    reference.fit(x, y, batch_size=4, verbose=0)
    with pytest.warns(UserWarning, match="cells take their inputs through routes"):
        model.fit(x, y, batch_size=4, verbose=0)
    assert model.unrolled and max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5


def _masked():
    keras.utils.set_random_seed(8)
    tokens = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(10, 4, mask_zero=True)(tokens)
    x = keras.layers.Dense(4, activation="tanh")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)  # averages over the unmasked steps only
    return keras.Model(tokens, keras.layers.Dense(2)(x))


def test_masks_cross_cuts_as_tensors():
    reference, own = _masked(), _masked()
    # Nodes: embedding | dense | the embedding's mask (a keras.ops node), pooling, dense: both masks cross cuts.
    model = tfpipe.PipelineModel(own, balance=[1, 1, 3], devices=cpu_devices(3), num_micro_batches=2)
    x = np.array([[1, 2, 0, 0, 0], [3, 0, 0, 0, 0], [4, 5, 6, 0, 0], [7, 8, 9, 1, 0]], "int32")
    y = np.random.default_rng(0).standard_normal((4, 2)).astype("float32")
    for net in (reference, model):
        net.compile(optimizer="sgd", loss="mse")
        net.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_dict_inputs_are_flattened_in_the_models_order_whatever_their_key_order():
    graph = functional.Graph(_two_inputs())
    a, b = tf.zeros((2, 6)), tf.ones((2, 3))
    assert [t.shape[1] for t in graph.flatten_inputs({"b": b, "a": a})] == [6, 3]


def test_a_nested_model_called_with_training_false_is_expanded_and_runs_as_keras_runs_it():
    """``base(x, training=False)``: Keras' Functional call passes fit's training=True to every node inside
    anyway (BatchNormalization updates its statistics, Dropout draws); the base is cut in two all the same."""

    def make():
        keras.utils.set_random_seed(6)
        base_in = keras.Input((6,))
        h = keras.layers.Dense(8, name="base_dense")(base_in)
        h = keras.layers.BatchNormalization(name="base_bn")(h)
        h = keras.layers.Dropout(0.5, name="base_drop")(h)
        base = keras.Model(base_in, keras.layers.Dense(8, activation="tanh", name="base_out")(h), name="base")
        x = keras.Input((6,))
        return keras.Model(x, keras.layers.Dense(2, name="head")(base(x, training=False)), name="transfer")

    reference, model, x, histories = _fit_both(make, 2, m=1, n=8, balance=[2, 3])
    assert [node.name for node in model._graph.nodes][:2] == ["base_dense", "base_bn"]  # noqa: SLF001 - expanded
    assert max_rel_error(model.get_weights(), reference.get_weights()) < 1e-5
    bn = model.to_functional().get_layer("base").get_layer("base_bn")
    assert np.max(np.abs(bn.moving_mean.numpy())) > 1e-3  # updated, as in Keras' own fit
    np.testing.assert_allclose(histories[1]["loss"], histories[0]["loss"], rtol=1e-5)
