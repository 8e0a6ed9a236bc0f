"""Planning's progress, shown while it runs: each phase, how far through it, and the time its pace says is left.

``tfpipe.plan`` measures for minutes (its layers alone, whole steps of the model, the shortlist timed): a user
waiting on it sees one line when a phase starts, a line every few seconds as it goes ("3 of 14, about 40 s
left"), and one when it ends, through ``messages.say`` (stdout, or absl's log), as the model's own lines are.
``verbose=0`` says nothing.
"""

from __future__ import annotations

import time

from tfpipe import messages

EVERY_S = 5.0  # at most one line per this many seconds within a phase (the first and the last always)


class Progress:
    """The lines of one planning run: ``phase`` starts one of ``total`` steps, ``step`` counts one done."""

    def __init__(self, verbose: int = 1, prefix: str = "tfpipe.plan"):
        self.verbose, self.prefix = int(verbose), prefix
        self.began = time.monotonic()
        self._name, self._total, self._done = "", 0, 0
        self._phase_began = self._said = self.began

    def _say(self, text: str) -> None:
        if self.verbose > 0:
            messages.say(f"{self.prefix}: {text}")
            self._said = time.monotonic()

    def phase(self, name: str, total: int = 0) -> None:
        """Start phase ``name`` of ``total`` steps (0: one step, no count shown); ends the one before."""
        self.end()
        self._name, self._total, self._done = name, int(total), 0
        self._phase_began = time.monotonic()
        self._say(f"{name}" + (f" (0 of {total})" if total else "") + f", {self._elapsed()} in")

    def step(self, what: str = "") -> None:
        """One step of the phase done (``what``: which); a line if the last was long enough ago, or it is the last."""
        self._done += 1
        now = time.monotonic()
        last = self._total and self._done >= self._total
        if not self._total or (now - self._said < EVERY_S and not last):
            return
        pace = (now - self._phase_began) / self._done
        left = f", about {_seconds(pace * (self._total - self._done))} left in it" if not last else ""
        self._say(f"{self._name}: {self._done} of {self._total}" + (f" ({what})" if what else "") + left)

    def end(self) -> None:
        """End the phase under way (if any), saying how long it took."""
        if self._name:
            self._say(f"{self._name}: done in {_seconds(time.monotonic() - self._phase_began)}")
            self._name = ""

    def _elapsed(self) -> str:
        return _seconds(time.monotonic() - self.began)


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"
