"""What the planner cuts: a Functional model's nodes walked on copies, skips counted, tied weights on every reader."""

import keras
import numpy as np

import tfpipe
from tfpipe.partition import deferred
from tfpipe.planning import predict
from tfpipe.planning import profile as profile_lib
from tfpipe.planning import units as units_lib


def _skip_model() -> keras.Model:
    """in(8) -> a: Dense(16) -> b: Dense(16) -> Add(a, b) -> Dense(4): ``a`` skips over ``b``."""
    inputs = keras.Input((8,), name="x")
    a = keras.layers.Dense(16, name="a")(inputs)
    b = keras.layers.Dense(16, name="b")(a)
    added = keras.layers.Add(name="add")([a, b])
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(added))


def test_a_functional_models_units_are_its_nodes_and_a_skip_crosses_every_cut_it_spans():
    model = _skip_model()
    units = units_lib.of(model)
    assert isinstance(units, units_lib.Nodes) and len(units) == 4
    assert units_lib.names(units) == ["a", "b", "add", "out"]
    walked = list(units_lib.walk(units, np.ones((3, 8), "float32"), rows=5, device="/CPU:0"))
    # after a: a (read by b and add); after b: a and b; after add: its sum; after out: the model's output
    assert [w.crossing_bytes / 5 for w in walked] == [16 * 4, 2 * 16 * 4, 16 * 4, 4 * 4]
    assert [len(w.inputs) for w in walked] == [1, 1, 2, 1]
    assert walked[2].outputs[0].shape == (5, 16)
    # the user's layers are not run or changed: the walk ran copies (the clone's own weights)
    assert all(w.copy.weights[0] is not model.get_layer(w.copy.name).weights[0] for w in walked if w.copy.weights)


def test_a_layer_called_twice_counts_its_weights_once_and_its_reader_is_tied_to_it():
    inputs = keras.Input((8,))
    shared = keras.layers.Dense(8, name="shared")
    frozen = keras.layers.Dense(8, name="frozen", trainable=False)
    model = keras.Model(inputs, shared(frozen(shared(inputs))))
    weights, trainable, tied = units_lib.weights(units_lib.of(model))
    dense = (8 * 8 + 8) * 4.0
    assert weights == [dense, dense, 0.0] and trainable == [dense, 0.0, 0.0]  # a frozen layer: no gradient
    assert tied == [units_lib.Tied(owner=0, reader=2, weight_bytes=dense, trainable_bytes=dense)]


def _profile(tied: list) -> profile_lib.Profile:
    costs = profile_lib.LayerCosts([1.0] * 3, [1.0] * 3, [0.0] * 3, [0.0] * 3)
    return profile_lib.Profile(
        "/CPU:0", [100.0, 10.0, 0.0], [100.0, 10.0, 0.0], 0.0, [1.0] * 3, {1: costs}, "", tied=tied
    )


def test_a_cell_that_reads_a_tied_weight_holds_it_and_its_gradient_and_the_owner_its_slots():
    tie = units_lib.Tied(owner=0, reader=2, weight_bytes=100.0, trainable_bytes=100.0)
    profile = _profile([tie])
    assert profile.cell_weights(0, 3) == (110.0, 110.0, 0.0)  # one cell: held once
    assert profile.cell_weights(0, 2) == (110.0, 110.0, 0.0)
    assert profile.cell_weights(2, 3) == (100.0, 0.0, 100.0)  # a copy and its gradient, no slots
    reader = predict.cell_bytes(profile, 1, 2, 3, False, slots=2, m=1)
    untied = predict.cell_bytes(_profile([]), 1, 2, 3, False, slots=2, m=1)
    assert reader.static - untied.static == 100.0 + 100.0


def test_a_model_built_under_deferred_weights_is_walked_without_making_its_weights():
    with tfpipe.deferred_weights():
        model = _skip_model()
    walked = list(units_lib.walk(model, np.ones((2, 8), "float32"), rows=2, device="/CPU:0"))
    assert walked[-1].outputs[0].shape == (2, 4)
    dense = [(8 * 16 + 16) * 4.0, (16 * 16 + 16) * 4.0, 0.0, (16 * 4 + 4) * 4.0]
    assert units_lib.weights(units_lib.of(model))[0] == dense
    assert all(deferred.waiting(v) for v in model.weights)  # still only shapes: PipelineModel makes them
