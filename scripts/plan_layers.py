"""scripts/plan.py --pressed_rounds: the layers profiled alone at every size against as "auto" presses them, in turn."""

from __future__ import annotations

import contextlib
import statistics
import timeit
import types
from typing import Any

from scripts import plan_devices, plan_measure


def _summed(profile: Any) -> dict[int, float]:
    """Per micro-batch size, the layers' forward and backward seconds summed."""
    return {b: sum(c.forward_s) + sum(c.backward_s) for b, c in sorted(profile.by_batch.items())}


def _profile(
    layers: Any, x: Any, sizes: list[int], device: str, pressed: bool, devices: int, round_: int
) -> dict[str, Any]:
    """One profile of ``layers`` on ``device``: at every size, or under ``max_seconds="auto"`` as ``tfpipe.plan``
    bounds it on ``devices`` devices (``choose.auto_bound``); its progress shown as the planner shows it."""
    from tfpipe.planner import choose
    from tfpipe.planning import profile as profile_lib
    from tfpipe.planning.progress import Progress

    # without max_seconds and auto_bound the profile is unbounded: the progress only shows it
    progress = Progress(prefix=f"round {round_ + 1}, {'pressed' if pressed else 'every size'}")
    bound = choose.auto_bound(devices) if pressed else None
    began = timeit.default_timer()
    found = profile_lib.measure(layers, x, sizes, device, progress=progress, auto_bound=bound)
    progress.end()
    took = timeit.default_timer() - began
    return {"seconds": took, "summed": _summed(found), "notes": [n for n in found.not_run if "measured alone" in n]}


def rounds(spec: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """``count`` rounds of the model of ``spec``'s layers profiled at every size, then pressed, on its first device
    (a logical one, or a LocalCluster's first worker); each round's summed times per size and the pressed over the
    whole."""
    import tfpipe
    from tfpipe.planner import probe_fits
    from tfpipe.planning import search

    devices = None if spec.get("cluster") else plan_devices.logical_devices(spec["devices"], spec["device_type"])
    layers, x, _, _ = plan_measure.model_and_data(spec)
    space = search.Space(spec["devices"])
    # the sizes follow R and M, not K: one layer gives them, a keras_hub task too
    sizes = probe_fits.profile_sizes(search.micro_batch_sizes(spec["batch_size"], 1, space))
    found = []
    given = contextlib.nullcontext(types.SimpleNamespace(devices=devices))  # logical devices, as a cluster gives its
    with tfpipe.cluster.LocalCluster(spec["devices"]) if devices is None else given as on:
        for r in range(count):
            whole = _profile(layers, x, sizes, on.devices[0], False, spec["devices"], r)
            pressed = _profile(layers, x, sizes, on.devices[0], True, spec["devices"], r)
            ratios = {b: _ratio(pressed["summed"][b], whole["summed"][b]) for b in sizes}
            found.append({"whole": whole, "pressed": pressed, "ratios": ratios})
            print(_line(found[-1]), flush=True)
    return found


def _ratio(pressed: float, whole: float) -> float:
    """Pressed over whole; nan where the whole took no measurable time (tiny layers, their call's cost taken off)."""
    return pressed / whole if whole > 0 else float("nan")


def _shown(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio == ratio else "n/a"


def _line(found: dict[str, Any]) -> str:
    """One round: the summed ms per size, whole and pressed, and their ratio."""
    whole, pressed = found["whole"], found["pressed"]
    sizes = ", ".join(
        f"{b} rows {whole['summed'][b] * 1e3:.1f} / {pressed['summed'][b] * 1e3:.1f} ms ({_shown(found['ratios'][b])})"
        for b in whole["summed"]
    )
    return f"whole {whole['seconds']:.0f} s, pressed {pressed['seconds']:.0f} s: {sizes}"


def summary(found: list[dict[str, Any]]) -> str:
    """Per size, the pressed over the whole: min, median, max over the rounds; and the notes of the last."""
    sizes = list(found[0]["ratios"])
    lines = [
        f"{b} rows: pressed / whole {min(r):.2f}-{max(r):.2f}x (median {statistics.median(r):.2f})"
        if r
        else f"{b} rows: pressed / whole n/a (no measurable time timed whole)"
        for b in sizes
        for r in [[f["ratios"][b] for f in found if f["ratios"][b] == f["ratios"][b]]]
    ]
    return "\n".join(lines + found[-1]["pressed"]["notes"])
