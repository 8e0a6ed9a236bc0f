"""Several cells per device (interleaved, looped BFS, ZB-V) train exactly as plain Keras and GPipe do."""

import keras
import numpy as np
import pytest

import tfpipe
from tests.util import covering, cpu_devices, max_rel_error, mlp_layers, per_layer_error, stateful_layers, unet_error
from tfpipe import schedule as schedule_lib

SHARED = list(schedule_lib.SHARED_SCHEDULES)


def _train(net, n, optimizer="adam"):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")
    net.compile(
        optimizer=keras.optimizers.get({"class_name": optimizer, "config": {"learning_rate": 0.01}}), loss="mse"
    )
    net.fit(x, y, batch_size=n, epochs=2, shuffle=False, verbose=0)
    return net


@pytest.mark.parametrize(
    "schedule,d,m,n,remat",
    covering(
        [(schedule, *shape) for schedule in SHARED for shape in [(2, 3, 7, "never"), (4, 5, 11, "except_last")]],
        [("interleaved_1f1b", 4, 5, 11, "except_last"), ("looped_bfs", 2, 3, 7, "never")]
        + [("interleaved_zero_bubble", 4, 5, 11, "except_last"), ("zbv", 2, 3, 7, "never")]
        + [("dualpipev", 4, 5, 11, "except_last")],
    ),
)
def test_two_cells_per_device_train_like_plain_keras(schedule, d, m, n, remat):  # uneven micro-batches
    m = max(m, 2 * d - 1) if schedule == "dualpipev" else m  # its least M
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((8,)), *mlp_layers()])
    model = tfpipe.PipelineModel(
        mlp_layers(), num_partitions=2 * d, devices=cpu_devices(d), num_micro_batches=m, remat=remat, schedule=schedule
    )
    model.build((None, 8))
    model.set_weights(plain.get_weights())
    _train(plain, n)
    _train(model, n)
    assert model.num_devices == d and model.num_partitions == 2 * d
    assert model.devices == [cpu_devices(d)[c] for c in schedule_lib.placement(schedule, 2 * d, d)]
    assert max_rel_error(model.get_weights(), plain.get_weights()) < 1e-5


@pytest.mark.parametrize("schedule", covering(SHARED, ["interleaved_1f1b", "dualpipev"]))
def test_two_cells_per_device_give_gpipes_weights_with_dropout_and_batchnorm(schedule):
    # As tests/integration/test_schedules.py: SGD, and the error taken per layer.
    def train(name, devices):
        keras.utils.set_random_seed(5)
        model = tfpipe.PipelineModel(
            stateful_layers(), num_partitions=4, devices=devices, num_micro_batches=4, remat="always", schedule=name
        )
        model.build((None, 8))
        return _train(model, 9, "sgd")

    other, gpipe = train(schedule, cpu_devices(2)), train("gpipe", cpu_devices(4))
    assert per_layer_error(other.pipeline_layers, gpipe.pipeline_layers) < 1e-5


@pytest.mark.parametrize("schedule", covering(["interleaved_1f1b", "zbv", "dualpipev"], ["zbv"]))
def test_two_cells_per_device_train_a_functional_unet_like_the_model(schedule):
    assert unet_error(cpu_devices(2), 3, schedule) < 1e-5


def test_devices_are_the_k_devices_or_one_per_cell_as_the_schedule_places_them():
    kwargs = {"num_partitions": 4, "schedule": "zbv"}
    model = tfpipe.PipelineModel(mlp_layers(), devices=["/CPU:0", "/CPU:1", "/CPU:1", "/CPU:0"], **kwargs)
    assert model.devices == ["/CPU:0", "/CPU:1", "/CPU:1", "/CPU:0"] and model.num_devices == 2
    with pytest.raises(
        ValueError, match=r"which the schedule must place as \[0, 1, 1, 0\].*devices=\['/CPU:0', '/CPU:1'\]"
    ):
        tfpipe.PipelineModel(mlp_layers(), devices=["/CPU:0", "/CPU:1", "/CPU:0", "/CPU:1"], **kwargs)
    with pytest.raises(ValueError, match="3 devices take 6 cells, not 4"):
        tfpipe.PipelineModel(mlp_layers(), devices=cpu_devices(3), **kwargs)
    with pytest.raises(ValueError, match="6 cells do not divide over 4 devices"):
        tfpipe.PipelineModel(mlp_layers(), num_partitions=6, devices=cpu_devices(4), schedule="looped_bfs")
    with pytest.raises(ValueError, match=r"schedule='dualpipev' needs at least 2K - 1 = 3 micro-batches on 2 devices"):
        tfpipe.PipelineModel(mlp_layers(), num_partitions=4, devices=cpu_devices(2), schedule="dualpipev")  # M=1
    with pytest.raises(ValueError, match="schedule='zbv' needs unroll=True"):
        tfpipe.PipelineModel(mlp_layers(), devices=cpu_devices(2), unroll=False, remat="always", **kwargs)
    default = tfpipe.PipelineModel(mlp_layers(), num_partitions=8, schedule="interleaved_1f1b")  # the 4 devices here
    assert default.devices == cpu_devices(4) * 2 and default.num_devices == 4


def test_a_shared_schedule_is_shown_and_saved(tmp_path):
    model = tfpipe.PipelineModel(
        mlp_layers(), balance=[3, 2, 3, 2], devices=cpu_devices(2), num_micro_batches=4, schedule="interleaved_1f1b"
    )
    model.build((None, 8))
    lines = []
    model.summary(print_fn=lines.append)
    assert "schedule='interleaved_1f1b' (bubble 11.1%) over 2 devices" in lines[0]  # (K-1)/(vM+K-1) = 1/9
    _train(model, 8, "sgd")
    model.save(str(tmp_path / "m.keras"))
    loaded = keras.models.load_model(str(tmp_path / "m.keras"))
    assert loaded.schedule == "interleaved_1f1b" and loaded.devices == model.devices and loaded.num_devices == 2
    assert max_rel_error(loaded.get_weights(), model.get_weights()) == 0


def test_the_planner_plans_several_cells_a_device_and_the_plan_trains_like_plain_keras():
    # ZB-V; interleaved 1F1B is planned alike (tests/unit/planning/test_plan_shared.py)
    x = np.zeros((8, 8), "float32")
    plan = tfpipe.plan(
        mlp_layers(), 8, cpu_devices(2), sample=x, schedules=["zbv"], replicas=False, verify=0, verbose=0, max_seconds=5
    )
    assert plan.schedule == "zbv" and plan.devices == cpu_devices(2)
    assert plan.num_partitions in (4, 8) and len(plan.balance) == plan.num_partitions  # v = 2 or 4 a device
    assert plan.candidates[0].config.describe().startswith(f"K={plan.num_partitions} on 2 devices")
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((8,)), *mlp_layers()])
    model = tfpipe.PipelineModel(mlp_layers(), plan=plan)
    model.build((None, 8))
    model.set_weights(plain.get_weights())
    _train(plain, 8)
    _train(model, 8)
    assert model.num_devices == 2 and model.num_partitions == plan.num_partitions
    assert max_rel_error(model.get_weights(), plain.get_weights()) < 1e-5


def test_the_planner_refuses_a_written_schedule_before_measuring():
    written = schedule_lib.written(schedule_lib.device_orders("interleaved_1f1b", 4, 2, 2))
    with pytest.raises(ValueError, match="schedules holds a schedule written as data"):
        tfpipe.plan(mlp_layers(), batch_size=8, input_shape=(8,), devices=cpu_devices(2), schedules=[written])
    with pytest.raises(ValueError, match=r"cells_per_device must be a non-empty list of choices, got 2"):
        tfpipe.plan(mlp_layers(), batch_size=8, input_shape=(8,), devices=cpu_devices(2), cells_per_device=2)


def test_a_written_schedule_trains_like_plain_keras_and_is_saved_and_shown(tmp_path):
    # Interleaved zero bubble's orders written out in torch's action strings ("1I0": B(1,0), "0W2": W(0,2)).
    torch_kind = {"F": "F", "B": "I", "W": "W"}
    orders = [
        [f"{t.cell}{torch_kind[t.kind]}{t.micro_batch}" for t in order]
        for order in schedule_lib.device_orders("interleaved_zero_bubble", 4, 3, 2)
    ]
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((8,)), *mlp_layers()])
    model = tfpipe.PipelineModel(
        mlp_layers(), num_partitions=4, devices=cpu_devices(2), num_micro_batches=3, remat="never", schedule=orders
    )
    model.build((None, 8))
    model.set_weights(plain.get_weights())
    _train(plain, 7)
    _train(model, 7)
    assert max_rel_error(model.get_weights(), plain.get_weights()) < 1e-5
    assert model.devices == ["/CPU:0", "/CPU:1"] * 2 and model.schedule.splitlines()[1].startswith("F(1,0) F(1,1)")
    lines = []
    model.summary(print_fn=lines.append)
    assert "schedule=a written schedule on 2 devices (bubble" in lines[0]
    model.save(str(tmp_path / "m.keras"))
    assert keras.models.load_model(str(tmp_path / "m.keras")).schedule == model.schedule


def test_a_written_schedule_is_checked_before_any_weight_is_made():
    orders = [["F(0,0)", "F(0,1)", "B(0,0)", "B(0,1)"], ["F(1,0)", "B(1,0)", "F(1,1)"]]
    with pytest.raises(ValueError, match=r"The written schedule lacks B\(1,1\)\."):
        tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=2,
                             schedule=orders)  # fmt: skip
    with pytest.raises(ValueError, match=r"F\(0,1\) \(device 0\) is out of range: the model has 2 cells \(0-1\) and "
                                         r"1 micro-batches"):  # fmt: skip
        tfpipe.PipelineModel(mlp_layers(), num_partitions=2, devices=cpu_devices(2), schedule=orders)


def test_replicas_of_a_v_train_like_plain_keras():
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((8,)), *mlp_layers()])
    replicas = [["/CPU:0", "/CPU:1"], ["/CPU:2", "/CPU:3"]]
    model = tfpipe.PipelineModel(mlp_layers(), num_partitions=4, devices=replicas, num_micro_batches=2, schedule="zbv")
    model.build((None, 8))
    model.set_weights(plain.get_weights())
    _train(plain, 8)
    _train(model, 8)
    assert model.devices == [["/CPU:0", "/CPU:1", "/CPU:1", "/CPU:0"], ["/CPU:2", "/CPU:3", "/CPU:3", "/CPU:2"]]
    assert max_rel_error(model.get_weights(), plain.get_weights()) < 1e-5
