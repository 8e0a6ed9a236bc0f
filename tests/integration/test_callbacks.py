"""Keras callbacks on a PipelineModel: checkpoints, backup and resume, TensorBoard with a profile, LR schedules."""

import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.util import cpu_devices

EPOCHS = 3


def _data(n=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 6)).astype("float32")
    return x, np.tanh(x[:, :3] * 2.0).astype("float32")


def _model(lr=0.05):
    """Two cells, with Dropout so that resuming must also restore the random state."""
    keras.utils.set_random_seed(0)
    layers = [
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.3),
        keras.layers.Dense(16),
        keras.layers.Activation("tanh"),
        keras.layers.Dense(3),
    ]
    model = tfpipe.PipelineModel(layers, balance=[2, 3], devices=cpu_devices(2), num_micro_batches=2)
    model.compile(optimizer=keras.optimizers.Adam(lr), loss="mse")
    return model


class _Interrupt(keras.callbacks.Callback):
    """Fails in the middle of an epoch, as a preempted job would."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("preempted")


def test_interrupted_fit_resumed_with_backup_and_restore_equals_an_uninterrupted_one(tmp_path):
    x, y = _data()
    uninterrupted = _model()
    uninterrupted.fit(x, y, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0)

    backup = str(tmp_path / "backup")
    first = _model()
    with pytest.raises(RuntimeError, match="preempted"):
        first.fit(
            x,
            y,
            batch_size=8,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup), _Interrupt(epoch=1, batch=2)],
        )
    resumed = _model()  # a new process would build the model again from scratch
    history = resumed.fit(
        x,
        y,
        batch_size=8,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup)],
    )
    assert len(history.history["loss"]) == EPOCHS - 1  # epoch 0 was not run again
    for a, b in zip(resumed.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_model_checkpoint_files_load_as_the_model_was(tmp_path):
    x, y = _data()
    model = _model()
    path = str(tmp_path / "best.keras")
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=EPOCHS,
        verbose=0,
        callbacks=[keras.callbacks.ModelCheckpoint(path, monitor="loss", save_best_only=True)],
    )
    loaded = keras.models.load_model(path)
    assert loaded.balance == [2, 3] and loaded.devices == cpu_devices(2)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))  # loss fell each epoch

    weights = str(tmp_path / "w{epoch}.weights.h5")
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[keras.callbacks.ModelCheckpoint(weights, save_weights_only=True)],
    )
    again = _model()
    again.build((None, 6))
    again.optimizer.build(again.trainable_variables)  # so that its state loads too
    again.load_weights(str(tmp_path / "w1.weights.h5"))
    np.testing.assert_array_equal(again.predict(x, verbose=0), model.predict(x, verbose=0))


def _xplane_events(path):
    """Names of every event and stat of a profile (an XSpace protobuf)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    names = set()
    for plane in space.planes:
        names |= {m.name for m in plane.event_metadata.values()} | {m.name for m in plane.stat_metadata.values()}
    return names


def test_tensorboard_writes_scalars_and_a_profile_of_every_task(tmp_path):
    x, y = _data(64)
    logs = str(tmp_path / "logs")
    _model().fit(
        x, y, batch_size=8, epochs=2, verbose=0, callbacks=[keras.callbacks.TensorBoard(logs, profile_batch=(2, 3))]
    )
    events = glob.glob(os.path.join(logs, "train", "events.out.tfevents.*"))
    tags = {v.tag for e in tf.compat.v1.train.summary_iterator(events[0]) for v in e.summary.value}
    assert "epoch_loss" in tags
    profiles = glob.glob(os.path.join(logs, "train", "plugins", "profile", "*", "*.xplane.pb"))
    assert profiles
    names = _xplane_events(profiles[0])
    # each cell's forward and backward ops (B_i_0 recomputes, so its ops carry its own name)
    for task in ("F_0_0", "F_1_1", "B_1_0", "B_0_0"):
        assert any(f"/{task}/" in n for n in names), task
    # activations cross from cell 0's device to cell 1's, and gradients back
    assert any("device:CPU:0;" in n and n.split(";")[2].endswith("device:CPU:1") for n in names if n.count(";") > 2)
    assert any("device:CPU:1;" in n and n.split(";")[2].endswith("device:CPU:0") for n in names if n.count(";") > 2)


def test_learning_rate_callbacks_change_the_optimizer():
    x, y = _data()
    model = _model(lr=0.1)
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1))
    history = model.fit(x, y, batch_size=8, epochs=EPOCHS, verbose=0, callbacks=[schedule])
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.05, 0.1 / 3])
    assert float(model.optimizer.learning_rate) == pytest.approx(0.1 / 3)

    model = _model(lr=0.1)
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=100.0)
    model.fit(x, y, batch_size=8, epochs=EPOCHS, verbose=0, callbacks=[plateau])
    assert float(model.optimizer.learning_rate) == pytest.approx(
        0.1 * 0.5 ** (EPOCHS - 1)
    )  # the first epoch sets the best loss
