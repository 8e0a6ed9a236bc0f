"""--model=hub:NAME in the scripts: keras_hub causal LMs (models/hub.py) train pipelined and are timed."""

from __future__ import annotations

import csv
import json
import re

import pytest

from tests.util import run_fresh, run_script

pytest.importorskip("keras_hub")  # the hub extra (the test extra brings it)

TINY = ["--blocks=2", "--dim=32", "--batch_size=16", "--micro_batches=2", "--verbose=0", "--devices=/CPU:0,/CPU:1"]
LOSS = re.compile(r"loss ([\d.]+) -> ([\d.]+), accuracy ([\d.]+) -> ([\d.]+) \((.+?)\)")


def _train(runs: list[list[str]], before: str = "", timeout: int = 600) -> tuple[list[dict], str]:
    """Each run's train.run() report, one process for all (two logical CPU devices), and what it printed."""
    proc = run_fresh(
        f"""
        import json, sys
        import tensorflow as tf
        tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                                   [tf.config.LogicalDeviceConfiguration()] * 2)
        sys.argv = ["train.py"]
        from scripts import train
        {before}
        reports = []
        for flags in {runs!r}:
            train.FLAGS.unparse_flags()
            train.FLAGS(["train.py", *flags])
            reports.append(train.run())
        print("REPORTS", json.dumps(reports))
        """,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("REPORTS")[1]), proc.stdout


@pytest.mark.heavy(seconds=35)
def test_gpt2_learns_the_sort_task_in_two_cells():
    # (Llama trains across two worker processes in the benchmark test below; every causal LM: the slow sweep.)
    names = ["gpt2"]
    reports, out = _train([[f"--model=hub:{name}", *TINY, "--examples=128", "--epochs=2"] for name in names])
    lines = LOSS.findall(out)
    assert len(lines) == len(names), out[-3000:]
    for name, report, (start, final, _, _, scored) in zip(names, reports, lines, strict=True):
        assert report["final_loss"] < 0.85 * report["start_loss"], (name, report)
        assert report["final_accuracy"] > report["start_accuracy"], (name, report)
        assert scored == "sorted tokens" and float(final) < float(start)
        assert len(report["balance"]) == 2 and report["micro_batches"] == 2 and report["epochs_run"] == 2
    assert out.count("2 cells, balance=") == 1 and "Tied weights: cell 1 also uses token_embedding" in out
    assert out.count("balance [") == 1 and "on ['/CPU:0', '/CPU:1'], 2 micro-batches" in out


BAD_FLAGS = [
    (["--model=hub:nope"], "--model=hub:nope: models/hub.py has no keras_hub architecture 'nope'; use hub:NAME, NAME "),
    (["--model=hub:nope"], "gemma, gpt2, gpt_neox, llama, mistral, opt, phi3, qwen, qwen3"),
    (["--model=hub:bert"], "--model=hub:bert: BertTextClassifier is a text classifier, not a causal LM"),
    (["--model=hub:gpt2", "--hidden=64"], "--hidden=64: applies to --model=transformer, not --model=hub:gpt2"),
    (["--model=hub:llama", "--image_size=16"], "--image_size=16: applies to --model=amoebanet or resnet or unet"),
    (["--model=nope"], "--model=nope: use one of transformer, amoebanet, resnet, unet or keras:NAME, e.g. keras:Res"),
    (["--model=nope"], "or hub:NAME, e.g. hub:gpt2"),
]


def test_bad_hub_flags_name_the_fix():
    # One process, a fresh parse each (as test_train_script's bad flags); the last run without keras_hub.
    cases = [
        *BAD_FLAGS,
        (["--model=hub:gpt2"], '--model=hub:gpt2: needs keras_hub, the hub extra: pip install -e ".[hub]"'),
    ]
    proc = run_fresh(f"""
        import contextlib, io, json, sys
        sys.argv = ["train.py"]
        from scripts import train
        results = []
        for i, flags in enumerate({[flags for flags, _ in cases]!r}):
            if i == {len(cases) - 1}:
                sys.modules["keras_hub"] = None  # as where the hub extra is not installed
            train.FLAGS.unparse_flags()
            err, code = io.StringIO(), 0
            with contextlib.redirect_stderr(err):
                try:
                    train.main(train.parse_flags(["train.py", *flags]))
                except SystemExit as exit:
                    code = exit.code
            results.append([code, err.getvalue()])
        print("RESULTS", json.dumps(results))
    """)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULTS")[1])
    for (flags, message), (code, stderr) in zip(cases, results, strict=True):
        assert code == 2 and message in stderr and "Traceback" not in stderr, (flags, stderr[-1500:])


@pytest.mark.slow  # hub tasks: integration/test_hub.py
def test_speed_benchmark_times_a_hub_llama_against_one_worker(tmp_path):
    out = str(tmp_path / "llama")
    flags = ("--model=hub:llama", "--micro_batches=2", "--steps=1", "--warmup=1", "--warmup_s=0", "--blocks=2")
    proc = run_script("benchmark_speed.py", *flags, "--dims=16", "--seq_len=8", "--batch_sizes=4", "--vocab=40",
                      f"--out={out}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["size"], r["K"], r["M"]) for r in rows] == [("dim=16 batch=4", k, "2") for k in ("1", "2")]
    for r in rows:  # against one worker, K=1, M=1, as for the other models
        assert float(r["examples_per_s"]) > 0 and float(r["speedup"]) > 0
        assert float(r["speedup"]) == pytest.approx(float(r["examples_per_s"]) / float(r["reference"]))
    assert float(rows[-1]["ideal"]) == pytest.approx(4 / 3)
    table = open(out + ".md").read()
    assert "### hub:llama dim=16 batch=4, remat='except_last'" in table and ", vocabulary 40" in table
    assert "| K \\ M | 2 |" in table and re.search(r"\| 2 \| \d+\.\d\dx \(\d+% of 1\.33x", table), table


@pytest.mark.slow
def test_speed_benchmark_refuses_what_it_cannot_time():
    # (train.py's refusals, through the same scripts/hub_models.check, run in the default suite.)
    for flags, message in [
        (["--model=hub:bert"], "--model=hub:bert: BertTextClassifier is a text classifier, not a causal LM"),
        (["--model=hub:nope"], "models/hub.py has no keras_hub architecture 'nope'; use hub:NAME, NAME one of gemma"),
        (["--model=nope"], "--model=nope: use one of transformer, amoebanet, mlp, unet, resnet50 or hub:NAME"),
        (["--model=mlp", "--vocab=40"], "--vocab applies to --model=transformer or hub:NAME, not --model=mlp"),
    ]:
        refused = run_script("benchmark_speed.py", *flags)
        assert refused.returncode != 0 and message in refused.stderr, (flags, refused.stderr[-1500:])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "gemma", "llama", "mistral", "qwen", "qwen3", "phi3", "opt", "gpt_neox"])
def test_every_hub_causal_lm_learns_the_sort_task(name):
    (report,), _ = _train([[f"--model=hub:{name}", *TINY, "--examples=256", "--epochs=2"]])
    assert report["final_loss"] < 0.85 * report["start_loss"], report


@pytest.mark.slow
def test_a_hub_lm_resumes_from_model_dir_and_trains_on_tfds_text(tmp_path):
    model_dir = str(tmp_path / "run")
    run = ["--model=hub:gpt2", *TINY, "--examples=128", f"--model_dir={model_dir}"]
    text = ["--model=hub:llama", *TINY, "--dataset=tfds:imdb_reviews", "--seq_len=16", "--epochs=2"]
    first, resumed, tfds_text = _train(
        [[*run, "--epochs=1"], [*run, "--epochs=3"], text],
        before="import tensorflow_datasets as tfds; mock = tfds.testing.mock_data(num_examples=64); mock.__enter__()",
    )[0]
    assert resumed["resumed_from_epoch"] == 1 and resumed["epochs_run"] == 2
    assert resumed["start_loss"] == pytest.approx(first["final_loss"], abs=2e-3)
    assert resumed["final_loss"] < resumed["start_loss"]
    assert tfds_text["final_loss"] < tfds_text["start_loss"]  # byte-level text, the padding masked
