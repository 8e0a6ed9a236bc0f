"""benchmarks/gpu_checks.py's CPU dry run: every GPU check's command runs, within its budget, and says how it went."""

import pytest

from tests.util import run_script


@pytest.mark.heavy(seconds=60)
def test_the_dry_run_runs_every_step_and_writes_the_summary(tmp_path):
    pytest.importorskip("keras_hub")  # the capacity step builds a keras_hub Llama
    out = tmp_path / "checks"
    proc = run_script("gpu_checks.py", "--dry_run", f"--out_dir={out}", "--budget_s=400")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert summary.startswith("gpu_checks (dry run, CPU): ")
    for step in ("tests", "overhead", "planner", "capacity"):
        assert f"| {step} | ok |" in summary, summary
        assert (out / f"{step}.log").exists()
    assert (out / "capacity_gpu.md").exists() and (out / "plan_gpu_mlp.md").exists()


def test_a_step_it_does_not_know_is_refused(tmp_path):
    proc = run_script("gpu_checks.py", "--dry_run", "--steps=tests,speed", f"--out_dir={tmp_path}")
    assert proc.returncode != 0 and "--steps: unknown ['speed']; use tests, overhead, planner, capacity" in proc.stderr
