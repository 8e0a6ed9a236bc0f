"""The main job, scripts/train.py: runs learn, resume from --model_dir, TFDS data; bad flags fail in one line."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.util import REPO, run_fresh

SCRIPT = os.path.join(REPO, "scripts", "train.py")
TINY_TRANSFORMER = ("--examples=256", "--blocks=1", "--dim=32", "--hidden=64", "--verbose=0")


def _run(*flags, timeout=300, env=None):
    env = env if env is not None else dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True, env=env, timeout=timeout)


def _losses(stdout):
    found = re.search(r"loss ([\d.]+) -> ([\d.]+), accuracy ([\d.]+) -> ([\d.]+)", stdout)
    assert found, stdout
    return float(found.group(1)), float(found.group(2))


def test_small_default_run_lowers_the_loss():
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # as a user runs it
    proc = _run("--examples=512", "--epochs=2", "--blocks=2", "--verbose=0", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if not os.path.exists("/proc/driver/nvidia"):  # TensorFlow's CUDA probe finds nothing: nothing to say
        assert "cuInit" not in proc.stderr and "cudart_stub" not in proc.stderr, proc.stderr[-2000:]
    start, final = _losses(proc.stdout)
    assert final < 0.5 * start
    assert "balance [2, 3] on ['/CPU:0', '/CPU:1'], 4 micro-batches" in proc.stdout
    assert "examples/s" in proc.stdout and "Predicted pipeline efficiency" in proc.stdout
    assert re.search(r"\(sorted tokens\); held-out accuracy [01]\.\d{3}", proc.stdout)  # never trained on


@pytest.mark.slow  # U-Nets train in tests/integration/test_functional.py; --model: the default run above
def test_unet_a_functional_model_learns_the_segmentation_task():
    proc = _run(
        "--model=unet",
        "--unet_depth=2",
        "--image_size=16",
        "--examples=256",
        "--epochs=3",
        "--verbose=0",
        "--devices=cpu:4",
        "--partitions=4",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r"accuracy ([\d.]+) -> ([\d.]+) \(pixels\)", proc.stdout)
    assert found and float(found.group(2)) > 0.8, proc.stdout[-2000:]
    assert "Cut 2|3:" in proc.stdout  # the summary lists the tensors crossing each cut


@pytest.mark.slow  # --schedule is passed on as --micro_batches is; the schedules: tests/integration
def test_other_schedules_train_from_the_command_line():
    # One process runs the script's main for each schedule (a process each took 60 s of the suite).
    proc = run_fresh(f"""
        import contextlib, io, sys
        sys.argv = ["train.py"]
        from scripts import train
        for schedule in ["zero_bubble", "gpipe_batched_w"]:  # 1F1B: the --schedule flag is passed on alike
            train.FLAGS.unparse_flags()
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                train.main(train.parse_flags(["train.py", *{TINY_TRANSFORMER!r}, "--epochs=2",
                                              f"--schedule={{schedule}}", "--remat=never"]))
            print("RUN", schedule, repr(out.getvalue()))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = dict(line.split(" ", 2)[1:] for line in proc.stdout.splitlines() if line.startswith("RUN "))
    assert sorted(runs) == ["gpipe_batched_w", "zero_bubble"], proc.stdout[-2000:]
    for schedule, stdout in runs.items():
        stdout = eval(stdout)
        start, final = _losses(stdout)
        assert final < start and f"schedule='{schedule}'" in stdout


def test_batched_weight_gradients_need_remat_never_on_the_command_line():
    proc = _run(*TINY_TRANSFORMER, "--schedule=gpipe_batched_w", "--remat=except_last")
    assert proc.returncode != 0
    assert "--schedule=gpipe_batched_w holds every micro-batch's activations" in proc.stderr


@pytest.mark.slow  # 67 s; replicas and XLA per cell are tested in test_replicas and test_jit_compile
def test_replicas_train_from_the_command_line_with_each_cell_compiled_by_xla():
    proc = _run(*TINY_TRANSFORMER, "--epochs=2", "--replicas=2", "--micro_batches=2", "--jit_compile")
    assert proc.returncode == 0, proc.stderr[-2000:]
    start, final = _losses(proc.stdout)
    assert final < start
    assert "2 replicas x 2 cells" in proc.stdout and ", each cell compiled by XLA" in proc.stdout  # the summary
    assert "on [['/CPU:0', '/CPU:1'], ['/CPU:2', '/CPU:3']], 2 micro-batches" in proc.stdout


@pytest.mark.slow  # keras.applications models train in tests/integration/test_applications.py
def test_a_keras_application_trains_by_name():
    proc = _run(
        "--model=keras:MobileNet",
        "--image_size=32",
        "--examples=16",
        "--batch_size=8",
        "--micro_batches=1",
        "--epochs=1",
        "--verbose=0",
        "--devices=cpu:2",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "balance [" in proc.stdout and "Cut 0|1:" in proc.stdout


@pytest.mark.slow  # 34 s of CPU; a fit resumed from its backup: tests/integration/test_callbacks.py
def test_resume_from_model_dir_continues_where_the_backup_left_off(tmp_path):
    model_dir = str(tmp_path / "run")
    first = _run(*TINY_TRANSFORMER, "--epochs=1", f"--model_dir={model_dir}", "--tensorboard")
    assert first.returncode == 0, first.stderr[-2000:]
    assert os.path.exists(os.path.join(model_dir, "latest.weights.h5"))
    assert os.listdir(os.path.join(model_dir, "logs"))
    _, first_final = _losses(first.stdout)
    second = _run(*TINY_TRANSFORMER, "--epochs=3", f"--model_dir={model_dir}")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming from epoch 1" in second.stdout and ", 2 epochs" in second.stdout
    second_start, second_final = _losses(second.stdout)
    assert second_start == pytest.approx(first_final, abs=2e-3)  # the same weights, on the same probe batches
    assert second_final < second_start


def test_tfds_image_and_text_data_sets_train_under_mock_data():
    proc = run_fresh(
        """
        import sys
        import tensorflow as tf
        import tensorflow_datasets as tfds
        tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                                   [tf.config.LogicalDeviceConfiguration()] * 2)
        from absl import app
        sys.argv = ["train.py"]
        from scripts import train
        reports = {}
        with tfds.testing.mock_data(num_examples=64):
            for name, flags in [("mnist", ["--model=resnet", "--stage_blocks=1,1", "--width=4", "--image_size=16"]),
                                ("imdb_reviews", ["--blocks=1", "--dim=16", "--hidden=32", "--seq_len=16"])]:
                train.FLAGS.unparse_flags()
                train.FLAGS(["train.py", f"--dataset=tfds:{name}", "--epochs=1", "--batch_size=16",
                             "--devices=/CPU:0,/CPU:1", "--verbose=0", *flags])
                reports[name] = train.run()
        print("REPORT", reports["mnist"]["balance"], reports["imdb_reviews"]["balance"],
              reports["mnist"]["final_loss"], reports["imdb_reviews"]["final_loss"])
    """,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.split("REPORT")[1]
    assert "(images)" in proc.stdout and "(next bytes)" in proc.stdout
    assert "nan" not in line
    assert proc.stdout.count('PipelineModel "pipeline_model') == 2  # each run printed its summary


BAD_FLAGS = [
    (["--micro_batches=0"], "train.py: error: --micro_batches=0: 0 is not a positive integer"),
    (["--model=resnet", "--depth=34"], "train.py: error: --depth=34: value should be one of <50|101>"),
    (["--stage_blocks=1,1,1,1"], "train.py: error: --stage_blocks=1,1,1,1: applies to --model=resnet, not "),
    (["--model=unet", "--dim=32"], "train.py: error: --dim=32: applies to --model=transformer or hub:NAME, not --"),
    (["--model=resnet", "--tie_embeddings"], "--tie_embeddings=True: applies to --model=transformer, not --model=resn"),
    (["--model=resnet", "--balance=3,3"], "train.py: error: --balance=3,3: balance=[3, 3] sums to 6"),
    (["--nope=1"], "train.py: error: Unknown command line flag 'nope'"),
    (["--balance=2,x"], "train.py: error: --balance=2,x: give comma-separated integers"),
    (["--devices=cpu:two"], "train.py: error: --devices=cpu:two"),
    (["--batch_size=2", "--micro_batches=4"], "--batch_size=2 is smaller than --micro_batches=4"),
    (["--dataset=imagenet"], "train.py: error: --dataset=imagenet: write 'synthetic' or tfds:NAME"),
    (["--tensorboard"], "--tensorboard writes under --model_dir"),
    (["--max_restarts=2", "--devices=local:2"], "--max_restarts restarts --devices=local:N workers from the backup"),
    (["--model=amoebanet", "--blocks=4"], "--model=amoebanet sizes: num_layers=4"),
    (
        ["--partitions=9", "--blocks=1"],
        "train.py: error: --partitions=9: num_partitions=9 is more",
    ),
    (["--devices=local:1"], "--devices=local:1 starts 1 workers for 2 cells; use local:2"),
    (["--replicas=2", "--devices=cpu:3"], "--replicas=2 x 2 cells need 4 devices; --devices=cpu:3 gives 3"),
    (["--replicas=2", "--batch_size=6"], "--batch_size=6 is smaller than --micro_batches=4 x --replicas=2"),
    (["--model=vgg"], "--model=vgg: use one of transformer, amoebanet, resnet, unet or keras:NAME"),
    (["--model=keras:Nope"], "--model=keras:Nope: keras.applications has no model 'Nope'"),
    (["--model=unet", "--image_size=20"], "--image_size=20 must be divisible by 2**--unet_depth=8"),
]


def test_bad_flags_name_the_flag():
    # Two as a user meets them (exit code 2, one line, no traceback; the second counts logical devices, which are
    # set once per process); the others through the script's own parse_flags and main in one process, each a fresh
    # parse (a process each took 50 s of the suite).
    alone = [BAD_FLAGS[0], next(case for case in BAD_FLAGS if "--devices=cpu:3" in case[0])]
    for flags, message in alone:
        proc = _run(*flags)
        assert proc.returncode == 2 and message in proc.stderr, (flags, proc.stderr[-1500:])
        assert "Traceback" not in proc.stderr
    together = [case for case in BAD_FLAGS if case not in alone]
    proc = run_fresh(f"""
        import contextlib, io, json, sys
        import tensorflow as tf
        sys.argv = ["train.py"]
        from scripts import train
        # Logical devices are set once per process; these runs all stop before a cell is placed.
        tf.config.set_logical_device_configuration = lambda *args: None
        results = []
        for flags in {[flags for flags, _ in together]!r}:
            train.FLAGS.unparse_flags()
            err, code = io.StringIO(), 0
            with contextlib.redirect_stderr(err):
                try:
                    train.main(train.parse_flags(["train.py", *flags]))
                except SystemExit as exit:
                    code = exit.code
            results.append([code, err.getvalue()])
        print("RESULTS", json.dumps(results))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULTS")[1])
    for (flags, message), (code, stderr) in zip(together, results, strict=True):
        assert code == 2 and message in stderr and "Traceback" not in stderr, (flags, stderr[-1500:])


def test_local_workers_run_the_cells_with_the_embedding_tied_across_them():
    proc = _run(*TINY_TRANSFORMER, "--epochs=1", "--devices=local:2", "--tie_embeddings")
    assert proc.returncode == 0, proc.stderr[-2000:]
    start, final = _losses(proc.stdout)
    assert final < start
    assert "on ['/job:worker/task:0/device:CPU:0', '/job:worker/task:1/device:CPU:0']" in proc.stdout
    assert "Tied weights: cell 1 also uses tokens/embeddings of cell 0" in proc.stdout  # the summary


def test_a_failed_import_inside_tensorflow_datasets_is_shown_as_it_is(tmp_path):
    # As on a machine where tensorflow-datasets is installed but a module its download code imports is not.
    fake = tmp_path / "importlib_resources"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'importlib_resources'\", name='importlib_resources')\n"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--model=amoebanet", "--dataset=tfds:mnist", f"--data_dir={tmp_path / 'data'}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "ModuleNotFoundError: No module named 'importlib_resources'" in proc.stderr, proc.stderr[-2000:]
    assert "needs tensorflow-datasets" not in proc.stderr


def test_a_data_set_that_is_not_there_and_cannot_be_downloaded_is_one_line(monkeypatch):
    import socket

    from scripts import data

    class Missing:  # what tfds.builder gives for a data set that is not in the data directory
        data_dir = "/data/mnist/3.0.1"
        url_infos = {"https://storage.example.com/mnist/train.gz": None, "https://storage.example.com/mnist/t.gz": None}

        def is_prepared(self):
            return False

    calls = []

    def unreachable(address, timeout):
        calls.append(address)
        raise OSError("Name or service not known")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    with pytest.raises(
        ValueError,
        match=r"mnist is not in the data directory /data/mnist/3.0.1 and cannot be "
        r"downloaded \(storage.example.com unreachable\); prepare it where there is a network",
    ):
        data._check_downloadable(Missing(), "mnist")
    assert calls == [("storage.example.com", 443)]  # each host once, with a deadline

    class Prepared(Missing):
        def is_prepared(self):
            return True

    data._check_downloadable(Prepared(), "mnist")  # there: nothing to download, no network needed
    assert len(calls) == 1


def test_the_data_extra_brings_what_the_tfds_download_path_imports(tmp_path):
    # A data set not yet downloaded: tensorflow-datasets reads its URLs through etils.epath, which imports
    # importlib_resources without tensorflow-datasets depending on it. The `data` and `test` extras bring it.
    proc = run_fresh(f"""
        import tensorflow_datasets as tfds
        builder = tfds.builder("mnist", data_dir={str(tmp_path)!r})
        print("PREPARED", builder.is_prepared())
        print("URLS", sorted(builder.url_infos)[0])
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PREPARED False" in proc.stdout and "URLS https://" in proc.stdout


def test_the_learning_rate_decays_to_a_tenth_over_the_run_when_its_length_is_known():
    proc = run_fresh("""
        from scripts import train
        train.FLAGS(["train.py", "--epochs=2", "--learning_rate=0.01"])
        schedule = train.learning_rate(5)  # 5 batches an epoch: 10 steps
        print("RESULT", float(schedule(0)), float(schedule(5)), float(schedule(10)), train.learning_rate(-2))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    start, middle, end, unknown = map(float, proc.stdout.split("RESULT")[1].split())
    assert start == pytest.approx(0.01) and end == pytest.approx(0.001) and end < middle < start
    assert unknown == 0.01  # a data set of unknown length (cardinality -2) keeps it constant
