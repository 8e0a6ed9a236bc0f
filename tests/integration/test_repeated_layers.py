"""repeated_layers="call": runs of alike layers traced once and called per layer train exactly as inline cells do."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.util import covering, cpu_devices, max_rel_error, per_layer_error, run_fresh
from tfpipe import updates
from tfpipe.models import transformer
from tfpipe.partition import repeats


def _blocks(depth=4):
    return transformer.transformer_lm(32, 8, depth, dim=16, hidden=32, heads=2, dropout=0.1)


def _lm(remat, schedule, repeated, depth=4):
    keras.utils.set_random_seed(3)
    model = tfpipe.PipelineModel(
        _blocks(depth),
        num_partitions=2,
        devices=cpu_devices(2),
        num_micro_batches=3,
        remat=remat,
        schedule=schedule,
        repeated_layers=repeated,
    )
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ids = np.random.default_rng(0).integers(0, 32, (7, 8))  # uneven micro-batches
    history = model.fit(ids, ids, batch_size=7, epochs=2, shuffle=False, verbose=0)
    return model, history.history["loss"]


@pytest.mark.slow  # called blocks: the keras_hub Llama test below; their Dropout seeds: the stateful test
@pytest.mark.parametrize("remat, schedule", [("except_last", "1f1b"), ("never", "zero_bubble")])
def test_called_blocks_train_a_transformer_with_dropout_as_inline_ones(remat, schedule):
    called, called_loss = _lm(remat, schedule, "call")
    inline, inline_loss = _lm(remat, schedule, "inline")
    assert np.allclose(called_loss, inline_loss, rtol=1e-5)
    # Per layer: attention's key bias has a zero gradient in exact arithmetic (softmax ignores it), float noise here.
    assert per_layer_error(called.pipeline_layers, inline.pipeline_layers) < 1e-5
    cells = called._pipeline.cells
    assert [c.repeats.num_traces for c in cells] == [2, 2]  # a block per micro-batch size (3, 2), not per block
    assert all(c.repeats.num_traces == 0 for c in inline._pipeline.cells)


def _stateful():
    """Alike runs of every kind of state: Dense x3, BatchNormalization x2 (statistics), Dropout x2 (seed state)."""
    return (
        [keras.layers.Dense(16)]
        + [keras.layers.Dense(16, activation="tanh") for _ in range(3)]
        + [keras.layers.BatchNormalization() for _ in range(2)]
        + [keras.layers.Dropout(0.2) for _ in range(2)]
        + [keras.layers.Dense(3)]
    )


def test_called_runs_keep_batchnorm_statistics_and_dropout_seeds_as_inline_ones():
    def train(repeated):
        keras.utils.set_random_seed(5)
        model = tfpipe.PipelineModel(
            _stateful(), balance=[4, 5], devices=cpu_devices(2), num_micro_batches=3, repeated_layers=repeated
        )
        model.compile(optimizer="sgd", loss="mse")
        rng = np.random.default_rng(1)
        x, y = rng.normal(size=(9, 8)).astype("float32"), rng.normal(size=(9, 3)).astype("float32")
        model.fit(x, y, batch_size=9, epochs=2, shuffle=False, verbose=0)
        return model

    called, inline = train("call"), train("inline")
    assert [c.repeats.num_traces for c in called._pipeline.cells] == [1, 2]  # Dense run; BatchNorm and Dropout runs
    assert per_layer_error(called.pipeline_layers, inline.pipeline_layers) < 1e-5
    moving = [v for v in called.non_trainable_weights if "moving" in v.path]
    assert (
        len(moving) == 4
        and max_rel_error(
            [v.numpy() for v in moving], [v.numpy() for v in inline.non_trainable_weights if "moving" in v.path]
        )
        < 1e-6
    )
    assert not np.allclose(moving[0].numpy(), 0.0)  # the statistics moved


def test_a_masked_sequence_runs_its_layers_inline_and_trains_as_plain_keras():
    def layers():
        return (
            [keras.layers.Embedding(10, 8, mask_zero=True)]
            + [keras.layers.Dense(8) for _ in range(3)]
            + [
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(3),
            ]
        )

    keras.utils.set_random_seed(2)
    plain = keras.Sequential([keras.Input((5,), dtype="int32"), *layers()])
    model = tfpipe.PipelineModel(
        layers(), balance=[6], devices=cpu_devices(1), num_micro_batches=2, repeated_layers="call"
    )
    model.build((None, 5))
    model.set_weights(plain.get_weights())
    ids = np.array([[1, 2, 0, 0, 0], [3, 4, 5, 0, 0], [6, 0, 0, 0, 0], [7, 8, 9, 1, 0]], "int32")
    y = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
    for net in (plain, model):
        net.compile(optimizer="sgd", loss="mse")
        net.fit(ids, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert model._pipeline.cells[0].repeats.num_traces == 0  # the mask would not cross a call: inline
    assert max_rel_error(model.get_weights(), plain.get_weights()) < 1e-5


def _cell_ops(repeated, depth):
    model = tfpipe.PipelineModel(_blocks(depth), balance=[depth + 3], devices=cpu_devices(1), repeated_layers=repeated)
    model.build((None, 8))
    cell = model._pipeline.cells[0]
    trainable, other = cell.read()
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.int32, (4, 8))
        trace = cell.traced(x, trainable, other, True)
        return len(trace.function.graph.get_operations())


def test_a_called_run_keeps_one_blocks_ops_whatever_the_depth():
    inline = {d: _cell_ops("inline", d) for d in (2, 8)}
    called = {d: _cell_ops("call", d) for d in (2, 8)}
    per_block = (inline[8] - inline[2]) / 6
    assert per_block > 50  # every block's ops inline
    assert (called[8] - called[2]) / 6 < per_block / 5  # a call and its arguments a block
    assert called[8] < inline[8] / 3


def test_runs_are_alike_consecutive_layers_with_variables_of_their_own():
    dense = [keras.layers.Dense(4) for _ in range(3)]
    other = keras.layers.Dense(4, activation="relu")
    layers = [keras.layers.Dense(4)] + dense + [other, keras.layers.Dense(4), keras.layers.Dense(4)]
    x = np.zeros((1, 4), "float32")
    for layer in layers:
        x = layer(x)
    assert repeats.runs(layers) == [(0, 4), (5, 7)]
    assert repeats.runs(layers[:6] + [layers[5]]) == [(0, 4)]  # one layer twice: its variables are not its own
    assert repeats.runs([keras.layers.Dense(4), keras.layers.Dense(4)]) == []  # not built: no variables to pass


def test_repeated_layers_is_checked_by_name_and_saved():
    with pytest.raises(ValueError, match=r"repeated_layers='calls'.*'inline'.*'call'"):
        tfpipe.PipelineModel(_blocks(2), num_partitions=1, repeated_layers="calls")
    model = tfpipe.PipelineModel(_blocks(2), balance=[5], devices=cpu_devices(1), repeated_layers="call")
    assert model.repeated_layers == "call" and model.get_config()["repeated_layers"] == "call"
    again = tfpipe.PipelineModel.from_config(model.get_config())
    assert again.repeated_layers == "call"


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "sgd": lambda: keras.optimizers.SGD(0.01, momentum=0.9, nesterov=True),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "lion": lambda: keras.optimizers.Lion(0.01),
}


@pytest.mark.parametrize("name", covering(sorted(OPTIMIZERS), ["adam", "adamw", "lion"]))  # moments, decay, a sign
def test_called_optimizer_updates_give_keras_own_weights(name):
    def train(repeated):
        keras.utils.set_random_seed(4)
        model = tfpipe.PipelineModel(
            _stateful(), balance=[4, 5], devices=cpu_devices(2), num_micro_batches=2, repeated_layers=repeated
        )
        model.compile(optimizer=OPTIMIZERS[name](), loss="mse")
        rng = np.random.default_rng(1)
        x, y = rng.normal(size=(8, 8)).astype("float32"), rng.normal(size=(8, 3)).astype("float32")
        model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
        return model

    called, inline = train("call"), train("inline")
    assert per_layer_error(called.pipeline_layers, inline.pipeline_layers) < 1e-6
    kinds = [t for traces in updates.traces(called.optimizer) for t in traces.values()]
    # One trace per kind of variable (shape, slots), not per variable; Nadam's update also writes its running
    # product, a variable of no one layer, so its updates stay Keras' own.
    shared = [t for t in kinds if t is not None]
    assert (len(shared) == 0) if name == "nadam" else (0 < len(shared) < len(called.trainable_variables))
    assert updates.traces(inline.optimizer) == []


def _functional(repeated, name):
    """A Functional model's blocks (the tied Transformer) or a keras_hub task's decoder blocks, trained 2 steps."""
    keras.utils.set_random_seed(0)
    if name == "tied":
        net = transformer.transformer_lm_tied(32, 8, 4, dim=16, hidden=32, heads=2, dropout=0.1)
        x = y = np.random.default_rng(0).integers(0, 32, (6, 8))
    else:
        hub = pytest.importorskip("tfpipe.models.hub")
        pytest.importorskip("keras_hub")
        net = hub.task(name, vocabulary_size=32, num_layers=4, hidden_dim=16, sequence_length=8, dropout=0.1)
        x = hub.inputs(net, 6, 8, 32)
        y = x["token_ids"]
    model = tfpipe.PipelineModel(
        net, num_partitions=2, devices=cpu_devices(2), num_micro_batches=2, repeated_layers=repeated
    )
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    return model, history.history["loss"]


@pytest.mark.slow  # called blocks: the optimizer, stateful and one-block tests above and below
@pytest.mark.parametrize("name", ["tied", "llama"])
def test_called_blocks_of_a_functional_model_and_a_keras_hub_task_train_as_inline_ones(name):
    # keras_hub's Llama decoder block cannot give its config (it reads an attribute it never set): its blocks are
    # found alike by what they hold instead.
    called, called_loss = _functional("call", name)
    inline, inline_loss = _functional("inline", name)
    assert np.allclose(called_loss, inline_loss, rtol=1e-6)
    assert per_layer_error(called.pipeline_layers, inline.pipeline_layers) < 1e-5  # attention's key bias: noise
    assert [c.repeats.num_traces for c in called._pipeline.cells] == [1, 1]


@pytest.mark.slow  # called blocks are tested in one process above, cells on workers in test_cluster.py
def test_called_blocks_and_updates_on_workers_train_as_inline_ones():
    # Cells and their called blocks in other processes, two cells a worker (the calls are made where the cell runs)
    proc = run_fresh("""
        import keras, numpy as np
        import tfpipe
        from tfpipe.cluster import LocalCluster
        from tfpipe.models import transformer
        from tests.util import per_layer_error

        ids = np.random.default_rng(0).integers(0, 32, (8, 8))
        with LocalCluster(2) as cluster:
            models = {}
            for mode in ("call", "inline"):
                keras.utils.set_random_seed(3)
                layers = transformer.transformer_lm(32, 8, 4, dim=16, hidden=32, heads=2, dropout=0.1)
                model = tfpipe.PipelineModel(layers, balance=[1, 2, 2, 2], devices=cluster.devices, num_micro_batches=4,
                                             schedule="interleaved_1f1b", repeated_layers=mode)
                model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
                model.fit(ids, ids, batch_size=8, epochs=2, verbose=0, shuffle=False)
                models[mode] = model
            traces = [c.repeats.num_traces for c in models["call"].cells]
            print("RESULT", per_layer_error(models["call"].pipeline_layers, models["inline"].pipeline_layers), traces)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    error, traces = proc.stdout.split("RESULT")[1].split(maxsplit=1)
    assert float(error) < 1e-5
    assert traces.strip() == "[0, 1, 1, 0]"  # the cells of two blocks call one trace; those of one block run inline


def test_the_planners_probes_are_built_as_the_model_will_train(monkeypatch):
    from tfpipe.planner import calibration, choose
    from tfpipe.planning import units

    ids = np.random.default_rng(0).integers(0, 32, (2, 8))
    kept = []
    for mode in ("call", "inline"):  # as plan(..., repeated_layers=mode) measures the model
        calibration.replicated_step(units.of(_blocks(2)), ids, 2, cpu_devices(1), "sgd", 1, kept, repeated_layers=mode)
    assert [kept[0].repeated_layers, kept[3].repeated_layers] == ["call", "inline"]
    with pytest.raises(ValueError, match=r"repeated_layers='calls'.*'inline'.*'call'"):
        tfpipe.plan(_blocks(2), 2, cpu_devices(1), sample=ids, repeated_layers="calls")
    asked = {}

    def plan(*args, **kwargs):  # plan="auto" plans as the model will train
        asked.update(kwargs)
        raise RuntimeError("planned")

    monkeypatch.setattr(choose, "plan", plan)
    model = tfpipe.PipelineModel(_blocks(2), plan="auto", devices=cpu_devices(1), repeated_layers="call")
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(RuntimeError, match="planned"):
        model.fit(ids, ids, batch_size=2, verbose=0)
    assert asked["repeated_layers"] == "call"
