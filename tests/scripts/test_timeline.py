"""scripts/timeline.py in its smallest mode: a CSV row for every task of the schedule, a PNG if matplotlib is there."""

import csv
import os
import re

import pytest

from tests.util import run_script


def _has_matplotlib() -> bool:
    """Whether matplotlib imports (it is an optional extra: ".[timeline]")."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _smallest(out, *flags):
    """Run the script on 2 logical CPU devices, tiny Transformer, one profiled step."""
    return run_script(
        "timeline.py",
        *flags,
        "--devices=cpu:2",
        "--micro_batches=2",
        "--batch_size=4",
        "--blocks=1",
        "--dim=16",
        "--seq_len=4",
        "--steps=1",
        "--warmup=1",
        f"--out={out}",
        *([] if _has_matplotlib() else ["--nopng"]),
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("timeline") / "tl")
    return _smallest(out), out


def _ideal_bubble(stdout):
    """The ideal bubble the summary states, checked to be the one it compares the measured bubble with."""
    ideal = re.search(r"ideal bubble of the schedule (\d\.\d+)", stdout).group(1)
    assert f"vs ideal {ideal}" in stdout
    return float(ideal)


def test_csv_has_every_task_of_the_schedule_and_a_summary(run):
    from tfpipe import schedule

    proc, out = run
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    tasks = {r["task"] for r in rows if r["task"]}
    want = {f"{t.kind}_{t.cell}_{t.micro_batch}" for t in schedule.flatten(schedule.gpipe(2, 2))}
    assert want <= tasks, f"missing {sorted(want - tasks)}"
    assert all(float(r["end_ms"]) >= float(r["start_ms"]) >= -1.0 for r in rows)
    phases = {r["phase"] for r in rows}
    assert {"forward", "backward", "recompute"} <= phases
    # Simulated from the measured task costs: GPipe's (K-1)/(M+K-1) = 1/3 with equal cells, here nearly so.
    assert 0.2 < _ideal_bubble(proc.stdout) < 0.5


def test_zero_bubble_draws_its_w_tasks_and_its_own_ideal(tmp_path):
    from tfpipe import schedule

    out = str(tmp_path / "zb")
    proc = _smallest(out, "--schedule=zero_bubble", "--remat=never")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        tasks = {r["task"] for r in csv.DictReader(f) if r["task"]}
    want = {f"{t.kind}_{t.cell}_{t.micro_batch}" for t in schedule.steps("zero_bubble", 2, 2) if t.kind != "B"}
    assert want <= tasks, f"missing {sorted(want - tasks)}"  # (cell 0's B tasks are empty: its inputs are data)
    assert "of which W" in proc.stdout and 0 < _ideal_bubble(proc.stdout) < 1  # tiny cells: costs are noise


@pytest.mark.slow  # W tasks are drawn in the zero bubble test above
def test_batched_w_draws_one_w_task_per_cell_counted_per_micro_batch(tmp_path):
    from tfpipe import schedule
    from tfpipe.analysis.graph_tasks import task_scope_name

    out = str(tmp_path / "bw")
    proc = _smallest(out, "--schedule=gpipe_batched_w", "--remat=never")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    tasks = {r["task"] for r in rows if r["task"]}
    assert {task_scope_name(t) for t in schedule.steps("gpipe_batched_w", 2, 2) if t.kind == "W"} <= tasks
    assert {r["micro_batch"] for r in rows if r["task"] == "W_1_all"} == {"all"}
    # The ideal counts an M-th of W(i, all) per micro-batch: "of which W" is per micro-batch.
    assert "of which W" in proc.stdout and 0 < _ideal_bubble(proc.stdout) < 1


@pytest.mark.slow  # a second whole run; several cells a device train in test_interleaved.py
def test_two_cells_per_device_are_drawn_on_their_device_with_their_schedules_ideal(tmp_path):
    from tfpipe import schedule

    out = str(tmp_path / "il")
    proc = _smallest(out, "--schedule=interleaved_1f1b", "--cells_per_device=2", "--blocks=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out + ".csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["device"] for r in rows} == {"/CPU:0", "/CPU:1"}
    assert {r["cell"] for r in rows if r["device"] == "/CPU:1" and r["task"]} == {"1", "3"}
    want = {f"{t.kind}_{t.cell}_{t.micro_batch}" for t in schedule.steps("interleaved_1f1b", 4, 2, num_devices=2)}
    tasks = {r["task"] for r in rows if r["task"]}
    assert want - {"B_0_0", "B_0_1"} <= tasks, f"missing {sorted(want - tasks)}"  # cell 0's B: inputs are data
    assert 0 < _ideal_bubble(proc.stdout) < 1  # tiny cells: costs are noise
    refused = run_script("timeline.py", "--schedule=1f1b", "--cells_per_device=2", timeout=120)
    assert refused.returncode != 0 and "--cells_per_device=2 needs a schedule that shares devices" in refused.stderr


def test_png_is_drawn(run):
    pytest.importorskip("matplotlib")
    proc, out = run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.getsize(out + ".png") > 1000


def test_without_matplotlib_a_png_request_names_the_extra():
    if _has_matplotlib():
        pytest.skip("matplotlib is installed")
    proc = run_script("timeline.py", "--devices=cpu:2", timeout=120)
    assert proc.returncode != 0 and 'pip install -e ".[timeline]"' in proc.stderr


@pytest.mark.slow  # a flag's error, a whole process
def test_bad_devices_flag_is_refused():
    proc = run_script("timeline.py", "--devices=gpu:2", timeout=120)
    assert proc.returncode != 0 and "cpu:N" in proc.stderr


def test_crossings_count_sends_a_step_and_the_kernels_slower_than_their_fastest_quartile():
    from scripts.timeline_analysis import Event, crossings

    ms = 1_000_000  # events are in ns
    windows = [(0, 100 * ms), (100 * ms, 200 * ms)]
    events = []
    for step in range(2):
        t0 = step * 100 * ms
        for mb in range(4):  # one layer's op, once a micro-batch: 1 ms, but 3 ms in step 1's last micro-batch
            took = 3 * ms if (step, mb) == (1, 3) else ms
            start = t0 + 10 * ms * (mb + 1)
            events.append(Event(0, f"F_0_{mb}", "forward", start, start + took, f"F_0_{mb}/dense/MatMul", "MatMul"))
        for send in range(3):  # three sends a step of 0.5 ms each, on the sender
            start = t0 + 60 * ms + send * ms
            events.append(Event(0, f"F_0_{send}", "forward", start, start + ms // 2, f"F_0_{send}/Send", "Send"))
    # an op with fewer runs than its quartile needs, and one outside the profiled steps, count for nothing
    events.append(Event(0, "B_0_0", "backward", 50 * ms, 59 * ms, "B_0_0/dense/MatMul_grad", "MatMul"))
    events.append(Event(0, "F_0_0", "forward", 300 * ms, 330 * ms, "F_0_0/dense/MatMul", "MatMul"))
    row = crossings(events, windows, ["dev0"]).splitlines()[1].split()
    assert row[:3] == ["dev0", "3.0", "1.50"]
    # 8 runs of one op took 10 ms where 8 at its lower quartile (1 ms) take 8: 1.25x, of 5 ms a step
    assert row[3:] == ["1.25x", "of", "5.0", "ms", "a", "step"]


def test_crossing_latency_is_from_a_send_to_the_waiting_receivers_next_op():
    from scripts.timeline_analysis import Event, crossing_latency

    ms = 1_000_000
    windows = [(0, 100 * ms)]

    def op(device, name, kind, start, end, phase="forward"):
        return Event(device, name.split("/")[0], phase, int(start * ms), int(end * ms), name, kind)

    events = [
        # F_0_0 crosses from device 0 to device 1, which waits: its next op starts 0.5 ms after the send's end
        op(0, "F_0_0/Send", "Send", 10, 11),
        op(1, "F_0_0/Recv", "Recv", 0, 0.1),  # asked for at the step's start: not the crossing
        op(1, "F_0_0/Recv", "Recv", 11.2, 11.3),
        op(1, "F_1_0/dense/MatMul", "MatMul", 11.5, 20),
        # F_0_1 crosses while device 1 computes: it did not wait, and counts for nothing
        op(0, "F_0_1/Send", "Send", 15, 16),
        op(1, "F_0_1/Recv", "Recv", 16.2, 16.3),
        op(1, "F_1_1/dense/MatMul", "MatMul", 20, 25),
        # B_1_0 crosses back to device 0, which waits 1.5 ms
        op(1, "B_1_0/Send", "Send", 30, 30.5, "backward"),
        op(0, "B_1_0/Recv", "Recv", 31, 31.1, "backward"),
        op(0, "B_0_0/dense/MatMul_grad", "MatMul", 32, 40, "backward"),
    ]
    latency, waited = crossing_latency(events, windows)
    assert waited == 2
    assert latency == pytest.approx(1.0)  # the median of 0.5 and 1.5
    assert crossing_latency(events[3:4], windows) == (0.0, 0)  # nothing crossed


def test_each_steps_idle_share_is_its_devices_mean_idle_over_its_window():
    from scripts.timeline_analysis import Event, step_shares, summarize

    ms = 1_000_000
    windows = [(0, 100 * ms), (200 * ms, 300 * ms)]
    events = [  # step 0: device 0 busy 80 ms (two ops overlapping 10), device 1 60; step 1: 100 and 40
        Event(0, "F_0_0", "forward", 0, 50 * ms),
        Event(0, "F_0_1", "forward", 40 * ms, 80 * ms),
        Event(1, "F_1_0", "forward", 10 * ms, 70 * ms),
        Event(0, "B_0_0", "backward", 200 * ms, 300 * ms),
        Event(1, "B_1_0", "backward", 230 * ms, 270 * ms),
        Event(1, "F_1_9", "forward", 150 * ms, 160 * ms),  # between the windows: no step's
    ]
    assert step_shares(events, windows, 2) == pytest.approx([0.3, 0.3])
    windows[1] = (200 * ms, 400 * ms)  # the second step slower: 0.65 idle
    assert step_shares(events, windows, 2) == pytest.approx([0.3, 0.65])
    assert "each step's: min 0.300, median 0.475, max 0.650" in summarize(events, windows, ["a", "b"], 0.1)


def test_the_calls_round_trip_is_told_from_the_idle_share_between_the_first_op_and_the_last():
    from scripts.timeline_analysis import Event, round_trips, summarize

    ms = 1_000_000
    windows = [(0, 100 * ms), (200 * ms, 300 * ms)]
    events = [  # step 0: the first op 10 ms after the call, the last ends 20 ms before it returns; step 1: 5 and 15
        Event(0, "F_0_0", "forward", 10 * ms, 50 * ms),
        Event(1, "F_1_0", "forward", 30 * ms, 80 * ms),
        Event(0, "B_0_0", "backward", 205 * ms, 285 * ms),
        Event(1, "B_1_0", "backward", 225 * ms, 265 * ms),
        Event(1, "F_1_9", "forward", 150 * ms, 160 * ms),  # between the windows: no step's
    ]
    # between the first op and the last: 70 ms with 40 and 50 busy (idle 0.357); 80 ms with 80 and 40 (0.25)
    found = round_trips(events, windows, 2)
    assert found == [pytest.approx((10.0, 20.0, 1 - 45 / 70)), pytest.approx((5.0, 15.0, 0.25))]
    assert round_trips(events[:1], windows[:1], 2) == []  # a device without ops in a step: no span to tell
    text = summarize(events, windows, ["a", "b"], 0.1)
    assert "the first op 7.50 ms after the call, the call back 17.50 ms after the last op" in text
    assert f"idle share from the first op to the last {(1 - 45 / 70 + 0.25) / 2:.3f}" in text
