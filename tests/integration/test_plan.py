"""tfpipe.plan as a user runs it: measure a model on two logical CPU devices, plan, build the planned model, train."""

import dataclasses
import gc
import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.util import cpu_devices, run_fresh
from tfpipe.planner import calibration as calibration_lib
from tfpipe.planner import probe_fits
from tfpipe.planning import profile as profile_lib
from tfpipe.planning import search

DEVICES = cpu_devices(2)


def _layers() -> list[keras.layers.Layer]:
    keras.utils.set_random_seed(1)
    return [keras.layers.Dense(64, activation="tanh") for _ in range(5)] + [keras.layers.Dense(4)]


@pytest.fixture(scope="module")
def planned():
    """One plan of a small MLP (batch 32, M in 1, 2, 4), made once for the module: measuring takes a while."""
    x = np.random.default_rng(0).standard_normal((32, 16)).astype("float32")
    # no time bound: every probe runs however loaded the machine is (the bound has a test of its own)
    kwargs = dict(sample=x, optimizer="sgd", num_micro_batches=[1, 2, 4], max_seconds=None)
    plan = tfpipe.plan(_layers(), 32, DEVICES, **kwargs)
    # the probes' models (kept in reference cycles) are gone when plan returns, not while the planned model trains
    probes = [o for o in gc.get_objects() if isinstance(o, keras.Model) and o.name.startswith("tfpipe_probe_")]
    assert probes == []
    return plan, x


@pytest.mark.heavy(seconds=50)
def test_a_plan_names_a_configuration_that_pipeline_model_builds_and_trains(planned):
    plan, x = planned
    assert isinstance(plan, tfpipe.Plan)
    assert sum(plan.balance) == 6 and len(plan.balance) == plan.num_partitions
    assert plan.num_micro_batches in (1, 2, 4) and plan.remat in ("always", "except_last", "never")
    assert plan.step_seconds > 0 and all(p > 0 for p in plan.peak_bytes)
    assert plan.candidates[0].prediction.step_s == plan.step_seconds
    # every configuration tried is predicted (no budget: everything fits); those predicted near the fastest (the
    # shortlist: one per shape) were timed on the devices, the chosen one the fastest of them. A shortlist of one is
    # not timed: which it is depends on this machine's speeds (under the suite's load, replicas alone came near)
    timed = [c for c in plan.candidates if c.measured_s is not None]
    listed = search.shortlist(plan.candidates, 3)
    assert {c.config for c in timed} == ({c.config for c in listed} if len(listed) >= 2 else set())
    assert plan.candidates[: len(timed)] == timed
    if timed:
        assert plan.measured_seconds == timed[0].measured_s == min(c.measured_s for c in timed)
    model = tfpipe.PipelineModel(_layers(), plan=plan)
    assert model.balance is None or model.balance == plan.balance
    assert (model.num_partitions, model.num_micro_batches, model.remat, model.schedule) == (
        plan.num_partitions,
        plan.num_micro_batches,
        plan.remat,
        plan.schedule,
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    y = np.tanh(x[:, :4])
    history = model.fit(x, y, batch_size=32, epochs=5, verbose=0)
    assert model.balance == plan.balance
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_the_summary_says_where_each_prediction_comes_from(planned):
    plan, _ = planned
    lines = []
    plan.summary(print_fn=lines.append)
    text = "\n".join(lines)
    assert "chosen: K=" in text and "predicted step:" in text and "runners-up" in text
    # this process runs without the BFC allocator: the bytes held are estimated, and the summary says so
    assert "estimated from output sizes" in text and "TF_CPU_ALLOCATOR_USE_BFC=true" in text
    assert "a step of all the layers as one cell on /CPU:0" in text
    # how many devices' worth of compute a pipeline and replicas get, each measured on the model
    c = plan.calibration
    assert 1.0 <= c.parallelism <= 2.0 and 1.0 <= c.replica_parallelism <= 2.0
    assert f"parallelism {c.parallelism:.2f} devices ({c.replica_parallelism:.2f} for replicas)" in text
    assert "replicas' parallelism measured with 2 replicas of the model at M=1" in text
    # one W over all micro-batches first joins their rows: what each layer joins, and the copy's speed
    assert plan.profile.joined_bytes == [(16 + 64) * 4] + [(64 + 64) * 4] * 4 + [(64 + 4) * 4]
    assert 1e-12 < c.copy_s_per_byte < 1e-8 and "a copy on a device" in text
    assert "one W over all micro-batches also copies the rows it joins" in text


def test_no_configuration_fits_names_the_budget_that_would_and_that_budget_fits(planned, monkeypatch):
    plan, x = planned
    # the plan's measurements reused: planned again under other budgets without measuring
    kwargs = dict(sample=x, optimizer="sgd", num_micro_batches=[1, 2, 4], calibration=plan.calibration)
    kwargs["profile"] = plan.profile
    with pytest.raises(
        tfpipe.NothingFits, match=r"No configuration fits memory_budget=1 KiB on every device: .* Pass "
    ):
        tfpipe.plan(_layers(), 32, DEVICES, "1KiB", **kwargs)
    smallest = min(max(c.prediction.peak_bytes) for c in plan.candidates)
    again = tfpipe.plan(_layers(), 32, DEVICES, smallest, **kwargs)
    assert max(again.peak_bytes) <= smallest
    # as a user would: the budget the error names, planned with what the error carries
    with pytest.raises(tfpipe.NothingFits) as raised:
        tfpipe.plan(_layers(), 32, DEVICES, "1KiB", **kwargs)
    error = raised.value
    assert error.smallest_budget == pytest.approx(smallest) and error.calibration == plan.calibration
    named = dict(kwargs, calibration=error.calibration, profile=error.profile)
    for module, name in ((calibration_lib, "calibrate"), (profile_lib, "measure"), (probe_fits, "fit_model")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("measured again"))
    fitted = tfpipe.plan(_layers(), 32, DEVICES, error.smallest_budget, **named)
    assert max(fitted.peak_bytes) <= error.smallest_budget
    # without a budget, the first plan's predictions again; its profile left as it was
    same = tfpipe.plan(_layers(), 32, DEVICES, verify=0, **kwargs)
    first = {c.config: c.prediction.step_s for c in plan.candidates}
    assert {c.config: c.prediction.step_s for c in same.candidates} == pytest.approx(first, rel=1e-9)
    assert same.profile is not plan.profile and same.calibration == plan.calibration


def test_a_budget_kept_by_bytes_estimated_from_outputs_is_warned_of(planned):
    plan, x = planned
    kwargs = dict(sample=x, optimizer="sgd", num_micro_batches=[1, 2, 4], calibration=plan.calibration, verify=0)
    estimated = dataclasses.replace(plan.profile, memory_device=None)  # as where no allocator counts bytes
    with pytest.warns(UserWarning, match=r"memory_budget=1 GiB a device, but no allocator here counts bytes.*"
                      r"Set TF_CPU_ALLOCATOR_USE_BFC=true"):  # fmt: skip
        tfpipe.plan(_layers(), 32, DEVICES, "1GiB", profile=estimated, **kwargs)
    read = dataclasses.replace(plan.profile, memory_device=DEVICES[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tfpipe.plan(_layers(), 32, DEVICES, "1GiB", profile=read, **kwargs)  # the bytes read
        tfpipe.plan(_layers(), 32, DEVICES, profile=estimated, **kwargs)  # no budget to keep
    assert not [w for w in caught if "TF_CPU_ALLOCATOR_USE_BFC" in str(w.message)]


def test_plan_with_settings_beside_it_is_an_error(planned):
    plan, _ = planned
    with pytest.raises(ValueError, match="plan= sets balance; leave it out"):
        tfpipe.PipelineModel(_layers(), plan=plan, balance=[3, 3])
    with pytest.raises(ValueError, match="The plan was made for 6 layers but this model has 3"):
        tfpipe.PipelineModel(_layers()[:3], plan=plan)
    with pytest.raises(TypeError, match="plan must be what tfpipe.plan"):
        tfpipe.PipelineModel(_layers(), plan={"balance": [3, 3]})


def test_arguments_are_checked_before_anything_is_measured():
    with pytest.raises(ValueError, match="pass sample=<one batch of inputs> or input_shape="):
        tfpipe.plan(_layers(), 32, DEVICES)
    with pytest.raises(ValueError, match="memory_budget must be a number of bytes"):
        tfpipe.plan(_layers(), 32, DEVICES, "lots", input_shape=(None, 16))
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        tfpipe.plan(_layers(), 0, DEVICES, input_shape=(None, 16))
    with pytest.raises(ValueError, match="Unknown optimizer 'lion'"):
        tfpipe.plan(_layers(), 32, DEVICES, input_shape=(None, 16), optimizer="lion")
    with pytest.raises(ValueError, match="Unknown schedule='pipedream'"):
        tfpipe.plan(_layers(), 32, DEVICES, input_shape=(None, 16), schedules=["pipedream"])
    for bad in (0, -5, "soon", True):
        with pytest.raises(ValueError, match=f"max_seconds={bad!r}: give the seconds planning may take"):
            tfpipe.plan(_layers(), 32, DEVICES, input_shape=(None, 16), max_seconds=bad)


def test_a_reused_profile_is_checked_before_anything_is_measured(planned):
    plan, x = planned
    with pytest.raises(ValueError, match="pass calibration=plan.calibration too"):
        tfpipe.plan(_layers(), 32, DEVICES, sample=x, profile=plan.profile)
    with pytest.raises(TypeError, match=r"profile must be a tfpipe plan's profile \(plan.profile\), got dict"):
        tfpipe.plan(_layers(), 32, DEVICES, sample=x, profile={}, calibration=plan.calibration)
    with pytest.raises(ValueError, match="profile=... was measured on 6 layers but 3 are planned"):
        tfpipe.plan(_layers()[:3], 32, DEVICES, sample=x, profile=plan.profile, calibration=plan.calibration)


@pytest.mark.slow  # plan='auto' at the first fit: test_plan_graphs' Functional model
def test_plan_auto_plans_at_the_first_fit_on_its_batch_and_trains_as_planned():
    x = np.random.default_rng(0).standard_normal((64, 16)).astype("float32")
    y = np.tanh(x[:, :4])
    model = tfpipe.PipelineModel(_layers(), plan="auto", devices=DEVICES, memory_budget="1GiB")
    assert model.plan is None and model.num_partitions == 1  # one placeholder cell until fit
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # a small batch: few micro-batch sizes to measure
    history = model.fit(data, epochs=4, verbose=0)
    plan = model.plan
    assert isinstance(plan, tfpipe.Plan) and plan.batch_size == 8 and plan.memory_budget == 2**30
    assert (model.balance, model.num_micro_batches, model.remat, model.schedule) == (
        plan.balance,
        plan.num_micro_batches,
        plan.remat,
        plan.schedule,
    )
    expected = plan.pipeline_arguments()["devices"]
    if plan.num_replicas == 1:  # each cell's device, as the schedule lays the cells out (several a device or one)
        expected = [plan.devices[d] for d in tfpipe.schedule.placement(plan.schedule, len(plan.balance), len(expected))]
    assert model.get_config()["devices"] == expected
    assert history.history["loss"][-1] < history.history["loss"][0]
    before = [w.copy() for w in model.get_weights()]
    model.fit(data, epochs=1, verbose=0)  # planned once: the next fit trains on
    assert model.plan is plan and any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert "plan" not in model.get_config() and model.get_config()["balance"] == plan.balance


def test_plan_auto_saved_before_its_first_fit_is_planned_by_the_loaded_models_fit():
    model = tfpipe.PipelineModel(_layers(), plan="auto", devices=DEVICES, memory_budget="64MiB")
    config = model.get_config()
    assert (config["plan"], config["memory_budget"], config["devices"]) == ("auto", "64MiB", DEVICES)
    assert not {"balance", "num_partitions", "num_micro_batches", "remat", "schedule"} & set(config)
    loaded = tfpipe.PipelineModel.from_config(config)
    assert loaded.plan is None and loaded.get_config()["plan"] == "auto"


def test_plan_auto_refuses_what_it_would_choose_and_data_it_cannot_plan_on():
    with pytest.raises(ValueError, match=r'plan="auto" chooses num_micro_batches, remat; leave them out'):
        tfpipe.PipelineModel(_layers(), plan="auto", num_micro_batches=4, remat="never")
    with pytest.raises(ValueError, match="memory_budget must be a number of bytes > 0 or a string such as"):
        tfpipe.PipelineModel(_layers(), plan="auto", memory_budget="plenty")
    model = tfpipe.PipelineModel(_layers(), plan="auto", devices=DEVICES)
    model.compile(optimizer="sgd", loss="mse")

    def batches():
        yield np.zeros((8, 16), "float32"), np.zeros((8, 4), "float32")

    with pytest.raises(ValueError, match=r'plan="auto" plans on the first training batch, .* \(generator\)'):
        model.fit(batches(), verbose=0)


@pytest.mark.heavy(seconds=15)
def test_timing_a_configuration_reads_each_workers_allocator_and_the_shared_ones_total():
    # the planner's last step checks a budget against what each worker's own allocator held; logical CPUs of one
    # process share one allocator, so there is no per-device peak to read there
    proc = run_fresh(
        """
        import json, numpy as np, keras, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        from tfpipe.planner import calibration
        from tfpipe.cluster import LocalCluster
        from tfpipe.planning.predict import Config

        layers = [keras.layers.Dense(256, activation="tanh") for _ in range(4)]
        x = np.ones((64, 256), "float32")
        config = Config((2, 2), 1, 2, "never", "1f1b")
        logical = calibration.configured_step(layers, x, 64, config, ["/CPU:0", "/CPU:1"], "adam", steps=2)
        with LocalCluster(2) as cluster:
            probe = calibration.configured_step(layers, x, 64, config, cluster.devices, "adam", steps=2)
            readable = calibration.peaks_readable(cluster.devices)
        result = {"peaks": probe.device_peaks, "logical": logical.device_peaks, "s": probe.seconds}
        result.update(total=logical.peak_bytes, readable=[readable, calibration.peaks_readable(["/CPU:0", "/CPU:1"])])
        print(json.dumps(result))
    """,
        env={"TF_CPU_ALLOCATOR_USE_BFC": "true"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    weights = 2 * 256 * 256 * 4  # two Dense(256) a worker: their weights, gradients and two Adam slots at least
    assert len(result["peaks"]) == 2 and all(p >= 4 * weights for p in result["peaks"]), result
    assert result["logical"] is None and result["s"] > 0
    # the logical CPUs' one allocator gives their total (which the planner compares per device used)
    assert result["total"] >= 8 * weights and result["readable"] == [True, True], result


def test_the_calibration_holds_nothing_on_its_devices_once_it_returns():
    # The update it times holds half the budget on the first device (weights, gradient, two slots), in reference
    # cycles of its functions: left to a later collection, they sat under the layers measured next (a planning peak
    # of 69 MiB where the probes' own was 48, 12 x Dense(1024) on workers)
    proc = run_fresh(
        """
        import json, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        from tfpipe.planner import calibration

        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        calibration.calibrate(["/CPU:0", "/CPU:1"], "adam", budget=64 * 2**20, most_tasks=8)
        after = tf.config.experimental.get_memory_info("CPU:0")
        print(json.dumps([before, after["current"], after["peak"]]))
    """,
        env={"TF_CPU_ALLOCATOR_USE_BFC": "true"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after, peak = json.loads(proc.stdout.strip().splitlines()[-1])
    assert peak - before >= 4 * 8 * 2**20  # the update's four tensors of an eighth of the budget were there
    assert after - before < 2**20


@pytest.mark.heavy(seconds=10)
def test_a_layer_timed_on_a_worker_is_traced_once_and_each_warm_up_run_waited_for():
    # A call on a remote device returns before it has run: a warm-up of 100 calls queued in no time made the first
    # timed call wait for all of them (1-2 s a size for each of AmoebaNet-D's cells on a worker)
    proc = run_fresh(
        """
        import numpy as np, keras, tensorflow as tf
        from tfpipe.cluster import LocalCluster
        from tfpipe.planning import profile

        with LocalCluster(1, threads_per_worker=1) as cluster:
            with tf.device(cluster.devices[0]):
                runs, a = tf.Variable(0), tf.random.normal((384, 384))
                layer = keras.layers.Dense(64)
                layer.build((None, 32))

            @tf.function
            def slow():  # tens of milliseconds on one thread
                b = a
                for _ in range(8):
                    b = tf.tanh(b @ b)
                runs.assign_add(1)
                return b[0, 0]

            with tf.device(cluster.devices[0]):
                profile.median_seconds(slow, 3, warm_s=0.05)
            measured = profile._Measured([layer], cluster.devices[0])
            x = tf.ones((2, 32))
            measured.traced(x)
            measured.ops(profile._rows(x, 8))
            for rows in (8, 32):
                measured.seconds(profile._rows(x, rows), 2, 0.0)
            counts = [f.experimental_get_tracing_count() for f in (measured._forward, measured._forward_backward)]
            print("RESULT", runs.numpy(), *counts)
    """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs, forward, forward_backward = map(int, proc.stdout.split("RESULT")[1].split())
    # the first call, the warm-up up to 0.05 s, three timed: not the 100 a warm-up that ran ahead queued
    assert 5 <= runs <= 30, runs
    # one trace general in the rows serves every size (not one for the first size, then one general)
    assert (forward, forward_backward) == (1, 1)


@pytest.mark.heavy(seconds=45)
def test_planning_keeps_to_the_budget_and_to_max_seconds_and_says_what_it_left_out():
    # 6 x Dense(256), Adam, batch 256 under 6 MiB per device: a step of the whole model on one device is predicted at
    # 7-9 MiB, so no probe of it runs; the allocator both logical CPUs share is read for planning's own peak
    proc = run_fresh(
        """
        import json, numpy as np, keras, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        import tfpipe

        keras.utils.set_random_seed(1)
        layers = [keras.layers.Dense(256, activation="tanh") for _ in range(6)]
        x = np.random.default_rng(0).standard_normal((256, 256)).astype("float32")
        kwargs = dict(sample=x, verbose=0, num_micro_batches=[1, 2, 4, 8])
        tight = tfpipe.plan(layers, 256, ["/CPU:0", "/CPU:1"], "6MiB", max_seconds=None, **kwargs)
        hurried = tfpipe.plan(layers, 256, ["/CPU:0", "/CPU:1"], max_seconds=1, **kwargs)
        lines = []
        tight.summary(print_fn=lines.append)
        print(json.dumps({
            "peaks": tight.planning_peaks, "seconds": tight.planning_seconds, "chosen": tight.peak_bytes,
            "not_run": tight.profile.not_run, "summary": lines, "hurried": hurried.profile.not_run,
            "hurried_timed": [c.measured_s for c in hurried.candidates if c.measured_s is not None],
            "listed": len(tfpipe.planning.search.shortlist(hurried.candidates, 3)),
        }))
    """,
        env={"TF_CPU_ALLOCATOR_USE_BFC": "true"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    budget = 6 * 2**20
    # every probe kept to the budget: the two devices' one allocator held at most what both may
    ((name, peak),) = result["peaks"].items()
    assert name == "2 logical devices' one allocator" and 0 < peak <= 2 * budget, result["peaks"]
    assert max(result["chosen"]) <= budget
    one_device = [line for line in result["not_run"] if "on 1 device(s) not run: predicted to peak at" in line]
    # the rest: probes over the budget or within its headroom, and perhaps the fastest configuration left untimed as
    # too near it
    near = [line for line in result["not_run"] if " not timed: predicted to peak at " in line]
    assert all(line.endswith("of the budget") for line in near), near
    over = [line for line in result["not_run"] if line not in near]
    ends = ("over the budget", "within 13% of the budget")
    assert one_device and all(line.endswith(ends) for line in over), result["not_run"]
    summary = "\n".join(result["summary"])
    assert "not scaled to whole steps: no one-cell step was run" in summary
    assert f"  planning: {result['seconds']:.0f} s, " in summary and "its probes held at most" in summary
    assert "(budget 6 MiB per device)" in summary and f"  not run: {one_device[0]}" in summary
    # a second's bound: no whole step of the model, nothing timed; the plan chosen by prediction alone, and said so
    assert result["hurried_timed"] == []
    # each probe predicted from its layers' tracing, past the time left
    probes = [line for line in result["hurried"] if line.startswith("probe ")]
    assert probes and all(" not run: predicted to take " in line for line in probes), probes
    assert all(line.endswith(", 0 s left within max_seconds") for line in probes), probes
    if result["listed"] >= 2:  # a shortlist of one is never timed
        assert result["hurried"][-1] == (
            "the shortlist not timed: no time left within max_seconds; chosen by prediction alone"
        )
