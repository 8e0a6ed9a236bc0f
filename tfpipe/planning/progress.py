"""Planning's progress and its time: each phase, how far through it, the time left, and whether a probe still fits it.

``tfpipe.plan`` measures for minutes (its layers alone, whole steps of the model, the shortlist timed): a user
waiting on it sees one line when a phase starts, a line every few seconds as it goes ("3 of 14, about 40 s
left"), and one when it ends, through ``messages.say`` (stdout, or absl's log), as the model's own lines are.
``verbose=0`` says nothing. Given ``max_seconds``, it is also the clock the planner keeps to: a probe (a model traced,
warmed up and timed) is built only where the time left ``affords`` it, at what it is predicted to take (from its
layers' own tracing, ``probe_fits.build_seconds``) scaled by what the probes built so far took against theirs, or at
their pace. The first probe too: a deep model's first whole step can take longer to build than its bound.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable

from tfpipe import messages

EVERY_S = 5.0  # at most one line per this many seconds within a phase (the first and the last always)
# The time left goes by the pace of the last this many steps: steps differ (a kind of layer is measured twice, then the
# rest of its kind are given its times), so the phase's first steps' pace overstated a deep model's by 50x
PACE_STEPS = 10


class Progress:
    """The lines of one planning run: ``phase`` starts one of ``total`` steps, ``step`` counts one done.

    ``max_seconds``: the time planning keeps to (None: no bound). ``on_step``: called after every step (the planner
    reads its devices' peaks there).
    """

    def __init__(
        self,
        verbose: int = 1,
        prefix: str = "tfpipe.plan",
        max_seconds: float | None = None,
        on_step: Callable[[], None] | None = None,
    ):
        self.verbose, self.prefix = int(verbose), prefix
        self.began = time.monotonic()
        self.max_seconds, self.on_step = max_seconds, on_step
        self._name, self._total, self._done = "", 0, 0
        self._phase_began = self._said = self.began
        self._recent: collections.deque[float] = collections.deque(maxlen=PACE_STEPS + 1)  # when the last steps ended
        self._probes: list[float] = []
        self._ratios: list[float] = []  # each probe built with a prediction: its seconds over the predicted
        self.phases: dict[str, float] = {}  # each phase ended: its seconds
        self.reserve = 0  # probes' worth of time kept for what comes after those asked about (the shortlist)

    def say(self, text: str) -> None:
        """One line of planning's own (silent with ``verbose=0``)."""
        if self.verbose > 0:
            messages.say(f"{self.prefix}: {text}")
            self._said = time.monotonic()

    def phase(self, name: str, total: int = 0) -> None:
        """Start phase ``name`` of ``total`` steps (0: one step, no count shown); ends the one before."""
        self.end()
        self._name, self._total, self._done = name, int(total), 0
        self._phase_began = time.monotonic()
        self._recent.clear()
        self._recent.append(self._phase_began)
        self.say(f"{name}" + (f" (0 of {total})" if total else "") + f", {self._elapsed()} in")

    def step(self, what: str = "") -> None:
        """One step of the phase done (``what``: which); a line if the last was long enough ago, or it is the last."""
        self.mark()
        self._done += 1
        now = time.monotonic()
        self._recent.append(now)
        last = self._total and self._done >= self._total
        if not self._total or (now - self._said < EVERY_S and not last):
            return
        pace = (now - self._recent[0]) / (len(self._recent) - 1)
        left = f", about {_seconds(pace * (self._total - self._done))} left in it" if not last else ""
        self.say(f"{self._name}: {self._done} of {self._total}" + (f" ({what})" if what else "") + left)

    def mark(self) -> None:
        """A moment worth ``on_step`` that is not a step of the phase (a group of probes timed in rounds)."""
        if self.on_step is not None:
            self.on_step()

    def end(self) -> None:
        """End the phase under way (if any), saying how long it took."""
        if self._name:
            took = time.monotonic() - self._phase_began
            self.phases[self._name] = self.phases.get(self._name, 0.0) + took
            self.say(f"{self._name}: done in {_seconds(took)}")
            self._name = ""

    def seconds(self) -> float:
        """Seconds since planning began."""
        return time.monotonic() - self.began

    def time_left(self) -> float:
        """Seconds left within ``max_seconds`` (inf without a bound; negative once over it)."""
        return float("inf") if self.max_seconds is None else self.max_seconds - self.seconds()

    def probe_took(self, seconds: float, predicted: float | None = None) -> None:
        """Count one probe built (traced, warmed up, timed once) in ``seconds`` where ``predicted`` said (None: no
        prediction): the pace and the factor ``affords`` goes by."""
        self._probes.append(float(seconds))
        if predicted:
            self._ratios.append(float(seconds) / predicted)

    def probe_seconds(self, predicted: float | None = None) -> float | None:
        """What one more probe is expected to take: ``predicted`` times the median of what those built with a
        prediction took against it (1 before any), else the mean of those built; None before any without one."""
        if predicted is not None:
            return predicted * (statistics.median(self._ratios) if self._ratios else 1.0)
        return self._pace()

    def affords(self, probes: int, also: float = 0.0, predicted: float | None = None) -> bool:
        """Whether ``probes`` more probes (each as ``probe_seconds(predicted)`` expects) and ``also`` seconds more fit
        the time left, with what the planner keeps for the shortlist (``reserve`` probes at the pace of those built)
        after them. The first probe keeps nothing back: it is built where it is expected to end within the bound, or
        without a prediction, where any time is left."""
        if self.max_seconds is None:
            return True
        each = self.probe_seconds(predicted)
        if each is None:
            return self.time_left() > 0
        return probes * each + self.kept() + also <= self.time_left()

    def kept(self) -> float:
        """Seconds kept for the shortlist: ``reserve`` probes at the pace of those built (none before the first)."""
        pace = self._pace()
        return self.reserve * pace if pace is not None else 0.0

    def _pace(self) -> float | None:
        """The mean seconds of the probes built; None before the first."""
        return sum(self._probes) / len(self._probes) if self._probes else None

    def _elapsed(self) -> str:
        return _seconds(self.seconds())


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"
