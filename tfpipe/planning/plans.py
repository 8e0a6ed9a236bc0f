"""A plan: the configuration the planner chose, its predictions, the runners-up and why they lost, the sources."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, cast

from tfpipe.planning import search
from tfpipe.planning.predict import Calibration, Config
from tfpipe.planning.profile import Profile
from tfpipe.planning.search import Candidate

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: Any, name: str = "memory_budget") -> float:
    """Bytes from an int or float, or a string such as "12GiB", "512 MB" or "1e9"; a ValueError names a bad one."""
    if isinstance(value, bool):
        value = None
    if isinstance(value, (int, float)) and 0 < value < float("inf"):
        return float(value)
    text = value.lower() if isinstance(value, str) else ""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+]?[0-9]+)?)\s*([kmgt]i?b|b)?\s*", text)
    if match:
        try:
            number = float(match.group(1)) * _UNITS[match.group(2) or ""]
        except ValueError:
            number = 0.0
        if number > 0:
            return number
    raise ValueError(f"{name} must be a number of bytes > 0 or a string such as '12GiB' or '512MB', got {value!r}.")


def gib(nbytes: float, up: bool = False) -> str:
    """Bytes in the largest binary unit they reach, 3 significant figures: '1.5 GiB', '12 MiB'; ``up``: rounded up."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)):
        if nbytes >= size or unit == "B":
            value = nbytes / size
            if up and value > 0:  # a budget read back from the message must fit
                step = 10 ** (math.floor(math.log10(value)) - 2)
                value = math.ceil(value / step - 1e-9) * step
            return f"{value:.3g} {unit}"
    return ""


class NothingFits(ValueError):
    """No configuration fits ``memory_budget`` on every device. It carries what planning measured, so that a plan under
    another budget (``smallest_budget``, say) measures nothing again: ``tfpipe.plan(..., calibration=e.calibration,
    profile=e.profile)``; and what planning itself held (``planning_peaks``, as ``Plan.planning_peaks``)."""

    def __init__(
        self,
        message: str,
        smallest_budget: float,
        config: Config,
        profile: Profile,
        calibration: Calibration,
        planning_peaks: dict[str, float] | None = None,
    ):
        super().__init__(message)
        self.smallest_budget = smallest_budget  # bytes a device: the smallest predicted peak of any configuration
        self.config = config  # the configuration that peaks at it
        self.profile, self.calibration, self.planning_peaks = profile, calibration, planning_peaks


@dataclasses.dataclass
class Plan:
    """A configuration predicted to fit the budget on every device: the fastest of those timed, else of those predicted.

    Pass it to ``PipelineModel(layers, plan=plan)``; ``summary()`` prints it with the runners-up.
    """

    num_partitions: int
    balance: list[int]
    num_replicas: int
    num_micro_batches: int
    remat: str
    schedule: str
    devices: list[str] | list[list[str]]
    step_seconds: float  # predicted
    peak_bytes: list[float]  # predicted, per device (replica by replica)
    batch_size: int
    memory_budget: float | None
    num_layers: int
    candidates: list[Candidate]  # every configuration tried, the chosen first: those timed, then as predicted
    profile: Profile
    calibration: Calibration
    optimizer_slots: int
    measured_seconds: float | None = None  # its step timed on the devices, where tfpipe.plan timed a shortlist
    planning_seconds: float | None = None  # how long tfpipe.plan took
    # the most bytes planning's own probes held beyond what was held when it began, by device (logical CPUs sharing
    # one allocator: one entry, their total); None where the devices' allocators cannot be read
    planning_peaks: dict[str, float] | None = None
    planning_bound: float | None = None  # the max_seconds it kept to (None: none)
    planning_phases: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds of each phase of planning

    @property
    def device_peaks(self) -> dict[str, float]:
        """Predicted peak bytes by device name."""
        if self.num_replicas > 1:
            flat = [d for row in self.devices for d in row]
        else:  # one list of devices: a type checker cannot tell that from num_replicas
            flat = cast("list[str]", list(self.devices))
        return dict(zip(flat, self.peak_bytes))

    def pipeline_arguments(self) -> dict[str, Any]:
        """The ``PipelineModel`` arguments this plan stands for."""
        return {
            "balance": list(self.balance),
            "devices": [list(r) for r in self.devices] if self.num_replicas > 1 else list(self.devices),
            "num_micro_batches": self.num_micro_batches,
            "remat": self.remat,
            "schedule": self.schedule,
        }

    def runners_up(self, count: int = 5) -> list[tuple[Candidate, str]]:
        """The next ``count`` configurations of other shapes (K, R, M, remat, schedule), each with why it lost."""
        chosen = self.candidates[0]
        out: list[tuple[Candidate, str]] = []
        seen = {_outcome(chosen)}
        for candidate in self.candidates[1:]:
            if len(out) == count:
                break
            if _outcome(candidate) in seen:
                continue  # predicted the same as one shown (M=1 runs every schedule alike): not news
            seen.add(_outcome(candidate))
            out.append((candidate, _why_lost(candidate, chosen, self.memory_budget)))
        return out

    def summary(self, print_fn: Callable[[str], None] | None = None, count: int = 5) -> None:
        """Print the chosen configuration, its predictions, where they come from, and the runners-up."""
        say = print_fn or print
        budget = f"memory budget {gib(self.memory_budget)} per device" if self.memory_budget else "no memory budget"
        say(f"tfpipe plan for a batch of {self.batch_size} over {self.num_layers} layers, {budget}:")
        say(f"  chosen: {self.candidates[0].config.describe()}")
        say(f"  devices: {self.pipeline_arguments()['devices']}")
        p = self.candidates[0].prediction
        say(
            f"  predicted step: {p.step_s * 1e3:.1f} ms (pipeline {p.pipeline_s * 1e3:.1f} + update "
            f"{p.update_s * 1e3:.1f} + fixed {p.fixed_s * 1e3:.1f})"
        )
        timed = [c.measured_s for c in self.candidates if c.measured_s is not None]
        if timed:
            say(
                f"  measured step: {timed[0] * 1e3:.1f} ms, the fastest of {len(timed)} configurations "
                f"timed on the devices (predicted within {search.SHORTLIST_BAND:.0%} of the fastest, one per K, R and "
                "schedule)"
            )
        say("  predicted peak memory: " + ", ".join(f"{d} {gib(v)}" for d, v in self.device_peaks.items()))
        if self.candidates[0].measured_peak is not None:
            say(
                f"  measured peak memory: {gib(self.candidates[0].measured_peak)} per device (the fullest one's; "
                "devices sharing one allocator: its total per device)"
            )
        for line in self.sources():
            say(f"  {line}")
        for line in self.planning():
            say(f"  {line}")
        say(f"  runners-up ({len(self.candidates) - 1} other configurations tried):")
        for candidate, why in self.runners_up(count):
            say(f"    {candidate.config.describe()}: {why}")

    def planning(self) -> list[str]:
        """What planning took (its time, in steps of the chosen configuration, and its probes' peaks) and what it did
        not run, one line each."""
        lines = []
        if self.planning_seconds is not None:
            step = self.measured_seconds or self.step_seconds
            line = f"planning: {self.planning_seconds:.0f} s, {self.planning_seconds / step:,.0f} steps of the chosen"
            if self.planning_bound is not None and self.planning_seconds > self.planning_bound and self.planning_phases:
                # what no bound leaves out: the devices and the layers are measured whatever it is
                name, took = max(self.planning_phases.items(), key=lambda item: item[1])
                line += f" (past max_seconds={self.planning_bound:.0f}; the longest part, {name}: {took:.0f} s)"
            peaks = self.planning_peaks
            if peaks:
                fullest = max(peaks, key=peaks.__getitem__)
                line += f"; its probes held at most {gib(peaks[fullest])} on {fullest}"
                if self.memory_budget is not None:
                    line += f" (budget {gib(self.memory_budget)} per device)"
            lines.append(line)
        lines += [f"not run: {why}" for why in self.profile.not_run]
        return lines

    def sources(self) -> list[str]:
        """Where each prediction comes from, one line each."""
        c = self.calibration
        return [
            f"layer times: measured on {self.profile.device} at each micro-batch size "
            f"({sorted(self.profile.by_batch)} samples): {self.profile.time_source}",
            f"layer memory: {self.profile.memory_source}; weights, gradients and {self.optimizer_slots} optimizer "
            "slot(s) per trainable weight counted from the variables",
            f"step costs ({c.source}): {c.task_s * 1e3:.2f} ms a task"
            + (
                f" ({c.noinline_task_s * 1e3:.2f} where cells are not inlined, from {c.noinline_tasks} tasks)"
                if c.noinline_task_s is not None
                else ""
            )
            + f", {c.step_s * 1e3:.2f} ms a step, "
            + _bandwidth(c.bandwidth)
            + f", parallelism {c.parallelism:.2f} devices"
            + (f" ({c.replica_parallelism:.2f} for replicas)" if c.replica_parallelism is not None else "")
            + (f", cells' layers x{c.split_speed:.2f} as fast cut as whole" if c.split_speed != 1.0 else "")
            + ", "
            f"update {c.update_s_per_byte * 2**20 * 1e3:.3f} ms per MiB of weights"
            + (f", a copy on a device {c.copy_s_per_byte * 2**20 * 1e3:.3f} ms per MiB" if c.copy_s_per_byte else ""),
            "schedule: simulated task by task (tfpipe.schedule.simulate); activations held per its in-flight count",
        ]


def _bandwidth(bytes_per_second: float) -> str:
    """The measured bandwidth between devices, or why there is none (one device, or faster than a call's noise)."""
    if math.isinf(bytes_per_second):
        return "transfers between devices too fast to time"
    return f"{bytes_per_second / 2**30:.2f} GiB/s between devices"


def _outcome(candidate: Candidate) -> tuple[str, str, str]:
    """A candidate's predicted step, largest peak and measured step as the summary shows them."""
    measured = f"{candidate.measured_s * 1e3:.1f}" if candidate.measured_s is not None else ""
    return f"{candidate.prediction.step_s * 1e3:.1f}", gib(max(candidate.prediction.peak_bytes)), measured


def _why_lost(candidate: Candidate, chosen: Candidate, budget: float | None) -> str:
    """Why ``candidate`` was not chosen: it does not fit, or how much slower it is predicted."""
    peak = max(candidate.prediction.peak_bytes)
    if not candidate.fits:
        return f"does not fit: predicted peak {gib(peak)} > budget {gib(budget or 0)}"
    if candidate.measured_s == float("inf"):
        return f"ran out of memory when timed on the devices (predicted peak {gib(peak)})"
    if candidate.measured_peak is not None and candidate.ran_over(budget):  # ran over: its peak was measured
        return f"its peak when timed, {gib(candidate.measured_peak)}, is over the budget (predicted {gib(peak)})"
    if candidate.measured_s is not None and chosen.measured_s is not None:
        slower = candidate.measured_s / chosen.measured_s - 1
        took, predicted = candidate.measured_s * 1e3, candidate.prediction.step_s * 1e3
        return f"{slower:+.0%} slower measured ({took:.1f} ms; predicted {predicted:.1f} ms), peak {gib(peak)}"
    slower = candidate.prediction.step_s / chosen.prediction.step_s - 1
    if slower < 0:  # the shortlist timed every shape predicted faster than the chosen: this one's shape ran slower
        return (
            f"predicted {-slower:.0%} faster ({candidate.prediction.step_s * 1e3:.1f} ms), not timed: the timed "
            f"configuration of its K, R and schedule ran slower; peak {gib(peak)}"
        )
    return f"{slower:+.0%} slower ({candidate.prediction.step_s * 1e3:.1f} ms), peak {gib(peak)}"


def from_candidates(
    candidates: Sequence[Candidate],
    devices: Sequence[str],
    batch_size: int,
    budget: float | None,
    profile: Profile,
    calibration: Calibration,
    slots: int,
    planning_peaks: dict[str, float] | None = None,
) -> Plan:
    """The plan of the first candidate (the fastest that fits); ``NothingFits`` naming the smallest budget if none fits
    (with ``planning_peaks``, what planning held: ``Plan.planning_peaks``)."""
    if not candidates:
        raise ValueError("No configuration to plan: give at least one layer, device and micro-batch count.")
    best = candidates[0]
    if not best.fits:
        smallest = min(candidates, key=lambda c: max(c.prediction.peak_bytes))
        needed = gib(max(smallest.prediction.peak_bytes), up=True)
        message = (
            f"No configuration fits memory_budget={gib(budget or 0)} on every device: the smallest predicted peak is "
            f"{needed}, with {smallest.config.describe()}. Pass memory_budget={needed!r} or more, more devices, or a "
            "smaller batch_size; tfpipe.plan(..., calibration=e.calibration, profile=e.profile), e this NothingFits, "
            "plans again without measuring."
        )
        device, held = max((planning_peaks or {"": 0.0}).items(), key=lambda item: item[1])
        if held > 0:  # nothing measured (a profile reused) holds nothing
            message += f" Planning itself held at most {gib(held)} on {device}."
        raise NothingFits(
            message, max(smallest.prediction.peak_bytes), smallest.config, profile, calibration, planning_peaks
        )
    config = best.config
    k, r = config.num_devices, config.num_replicas
    chosen = [list(devices[i * k : (i + 1) * k]) for i in range(r)]
    return Plan(
        num_partitions=config.num_partitions,
        balance=list(config.balance),
        num_replicas=r,
        num_micro_batches=config.num_micro_batches,
        remat=config.remat,
        schedule=config.schedule,
        devices=chosen if r > 1 else chosen[0],
        step_seconds=best.prediction.step_s,
        peak_bytes=list(best.prediction.peak_bytes),
        batch_size=batch_size,
        memory_budget=budget,
        num_layers=len(profile.output_bytes),
        candidates=list(candidates),
        profile=profile,
        calibration=calibration,
        optimizer_slots=slots,
        measured_seconds=best.measured_s,
    )
