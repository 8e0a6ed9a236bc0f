"""What the planner measures per layer: forward and backward seconds and the bytes a micro-batch holds, per batch size.

Each layer is copied and measured on one device, as ``tfpipe.cost`` does (the user's
layers are never built or run here): for every micro-batch size asked for, the median
seconds of its forward and of its backward, the bytes its forward leaves for the
backward (what a cell holds per micro-batch in flight without re-materialization), and
the extra bytes its backward needs at its peak. Memory is read from the device's
allocator (``get_memory_info``). A device of another process (a cluster's worker) is
not this process's to read: its bytes are read on this process's device of the same
type (``stand_in``), as they depend on the kernels, not on the process. Where no
allocator reports bytes (a CPU without ``TF_CPU_ALLOCATOR_USE_BFC=true``) the bytes held
are taken from the layer's output sizes instead, and ``Profile.memory_source`` says so.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import timeit
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfpipe import _compat
from tfpipe import cost as cost_lib
from tfpipe.graph import cpu_gradients
from tfpipe.partition import functional, hub, specs
from tfpipe.planning import held as held_lib
from tfpipe.planning import units as units_lib
from tfpipe.planning.progress import Progress
from tfpipe.planning.walk import same_layer_key, tensor_bytes

MEASURED = "measured with get_memory_info"
FROM_OUTPUTS = "estimated from output sizes (the allocator reports no bytes: set TF_CPU_ALLOCATOR_USE_BFC=true)"
# Layers of one kind (``walk.same_layer_key``: class, configuration, inputs' shapes) do the same work: the first this
# many are timed alone and the rest given their mean (``tie_alike`` gives them all the mean anyway). Timing each of 12 x
# Dense(1024) at 32, 256 and 2048 rows on a worker took 4.0 min of the planner's 4.2 before its first whole step.
ALIKE_TIMED = 2
WARM_S = 0.3  # each timed function's warm-up, at most (``median_seconds``)
# Under ``max_seconds``, the layers alone may take this share of the time left when they start; the rest is the whole
# steps' and the shortlist's. Where their pace says they would go past it, later layers are measured at fewer sizes
# (``_Tally``), warmed up for PRESSED_WARM_S and only the first of a kind timed: 4-block AmoebaNet-D (18 units, none
# alike but in pairs) took 77-82 s at three sizes under a 60 s bound, 0.9 s a size a unit of it warming up.
LAYERS_SHARE = 0.5
# ... and their bytes are given by the tensors their backward reads, counted in their traces (``planning.held``),
# times the median of what the allocator showed per counted byte of the units read before them, once this many were
# read at the size: reading traces each unit's backward a second time (0.6-1.2 s an AmoebaNet-D cell). Three: of
# two, AmoebaNet-D's stem (1.25 working bytes per counted one) and first cell (0.3-0.5), the median gave its later
# cells 2-3x the working bytes read
COUNTED_FROM = 3
PRESSED_WARM_S = 0.1  # a unit running for milliseconds has not had the ~90 runs settling its kernels by 0.3 s either
# ... and their forwards are neither traced nor timed alone (an AmoebaNet-D cell's: 0.26 s traced and first run, and a
# third of its timing): each takes the forward's share of the units timed at several sizes. Timed alone, one cell's
# share moved 0.18-0.61 between sizes of one profile, the cells' shares 0.22-0.48 at one size
# On a cluster the units' bytes are read on a stand-in first (``_bytes_on``), within this share of the time left; where
# their pace says they would go past it, later units are read at one size: 4-block AmoebaNet-D's 18 units took 28 s at
# three sizes on the client under "auto" (30 s)
BYTES_SHARE = 0.25
# A unit timed at one size alone is given other sizes through a fixed part per op that the units timed at several
# sizes showed (``_Sizes``), at most this share of its time: a stem's fixed part per op (110 ops forward and backward),
# given to AmoebaNet-D's cells of 961-1,273, could be more than their whole time
FIXED_SHARE = 0.9
# ... and where a unit has more than this many times the ops of those that gave the fixed part, it is timed at two sizes
# instead: on a worker the stem's line alone gave AmoebaNet-D's cells no fixed part: 2.3x their summed time at 16 rows
LINED_OPS = 4.0


@dataclasses.dataclass
class LayerCosts:
    """One micro-batch size's per-layer measurements (lists indexed by layer)."""

    forward_s: list[float]
    backward_s: list[float]
    held_bytes: list[float]  # left by the forward for the backward, the layer's output included
    working_bytes: list[float]  # the backward's peak above what the forward left


@dataclasses.dataclass
class Profile:
    """Per-unit measurements of a layer sequence or a graph's nodes at several micro-batch sizes, on ``device``."""

    device: str
    weight_bytes: list[float]  # per unit: its variables (trainable and not), a layer's at its first unit
    trainable_bytes: list[float]  # per unit: its trainable variables (gradients and optimizer slots follow them)
    input_bytes: float  # per sample: the model's inputs
    output_bytes: list[float]  # per sample: what crosses a cell boundary after each unit (a graph's skips included)
    by_batch: dict[int, LayerCosts]
    memory_source: str
    memory_device: str | None = None  # where the bytes were read (``device`` or its stand-in); None: estimated
    time_source: str = "each layer's forward and backward run alone"
    # What a micro-batch's activations hold in a real step against the layers' measured held bytes, by whether the
    # step inlines its cells' calls: (micro-batch sizes probed, ratios). Not probed: 1.0.
    held_ratios: dict[bool, tuple[list[int], list[float]]] = dataclasses.field(default_factory=dict)
    # What recomputing a micro-batch costs in a step against its forward task, by the number of cells it was fitted
    # at (planner._recompute_ratios): on devices that share a CPU it fills other devices' waits. Not probed: 1.0.
    recompute_ratios: dict[int, float] = dataclasses.field(default_factory=dict)
    # per sample: what one W over all micro-batches concatenates of each layer (``tfpipe.planning.joined``); none
    # where no batching schedule is searched
    joined_bytes: list[float] = dataclasses.field(default_factory=list)
    # a layer's weights that a later unit reads than the one counting them (a tied embedding; ``units.Tied``)
    tied: list[Any] = dataclasses.field(default_factory=list)
    # what planning did not run, to keep to the memory budget or to max_seconds, and what it did instead (the summary)
    not_run: list[str] = dataclasses.field(default_factory=list)
    # per unit: seconds its forward and backward took to trace and first run alone, beyond a later run (its kind's
    # mean where it took its kind's times); what building a probe of the whole model is predicted from
    # (``probe_fits.build_seconds``). Empty where not measured (a profile made by hand)
    trace_s: list[float] = dataclasses.field(default_factory=list)
    # whole steps of a batch that the planner's probes trained, by (batch size, the configuration each step is,
    # ``predict.Config``): their median seconds and largest device peak (None where not read). The shortlist takes
    # these rather than build such a configuration again; a profile reused for another plan has none
    steps: dict[tuple[int, Any], tuple[float, float | None]] = dataclasses.field(default_factory=dict)

    def cell_weights(self, lo: int, hi: int) -> tuple[float, float, float]:
        """Units [lo, hi) as one cell: the bytes of the weights it holds, of the trainable ones it owns (their
        gradients and optimizer slots are its), and of trainable ones it reads from an earlier cell (a gradient of
        its own, summed into the owner's: no slots)."""
        weights, owned = sum(self.weight_bytes[lo:hi]), sum(self.trainable_bytes[lo:hi])
        borrowed: dict[int, Any] = {}  # a layer read twice in one cell is held once
        for tie in self.tied:
            if lo <= tie.reader < hi and not lo <= tie.owner < hi:
                borrowed[tie.owner] = tie
        weights += sum(tie.weight_bytes for tie in borrowed.values())
        return weights, owned, sum(tie.trainable_bytes for tie in borrowed.values())

    def costs(self, batch: int) -> LayerCosts:
        """The measurements at micro-batch size ``batch`` (a ValueError if it was not profiled)."""
        if batch not in self.by_batch:
            raise ValueError(f"micro-batch size {batch} was not profiled; profiled: {sorted(self.by_batch)}.")
        return self.by_batch[batch]

    def recompute_ratio(self, num_partitions: int) -> float:
        """What recomputing a micro-batch costs against its forward at K cells: fitted at the Ks probed, linear
        between them (the more cells share the devices, the more of it fills their waits), the nearest outside."""
        if not self.recompute_ratios:
            return 1.0
        ks = sorted(self.recompute_ratios)
        return float(np.interp(num_partitions, ks, [self.recompute_ratios[k] for k in ks]))

    def held_ratio(self, batch: int, inlined: bool) -> float:
        """What a step's micro-batch of ``batch`` rows holds against the layers' measured bytes (interpolated)."""
        sizes, ratios = self.held_ratios.get(inlined, ([], []))
        if not sizes:
            return 1.0
        return float(np.interp(np.log2(batch), np.log2(sizes), ratios))


def memory_name(device: str) -> str | None:
    """The name ``get_memory_info`` knows ``device`` by, or None where its allocator counts no bytes.

    A CPU's allocator counts only with ``TF_CPU_ALLOCATOR_USE_BFC=true``; a device of another process (a
    cluster's worker) is not this process's to read.
    """
    spec = tf.DeviceSpec.from_string(device)
    if spec.job not in (None, "localhost"):
        return None
    name = f"{(spec.device_type or 'CPU').upper()}:{spec.device_index or 0}"
    if name.startswith("CPU") and os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() not in ("1", "true"):
        return None
    try:
        tf.config.experimental.get_memory_info(name)
    except (ValueError, tf.errors.OpError):
        return None
    return name


def stand_in(device: str) -> str | None:
    """Where to read ``device``'s bytes: itself, else this process's device of its type, else None (nowhere).

    A worker's layers hold what the same kernels hold in this process; its allocator is its own process's.
    """
    if memory_name(device) is not None:
        return device
    kind = (tf.DeviceSpec.from_string(device).device_type or "CPU").upper()
    local = f"/job:localhost/replica:0/task:0/device:{kind}:0"
    return local if memory_name(local) is not None else None


def median_seconds(fn: Any, repeats: int, warm_s: float = WARM_S) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after tracing and 100 runs or ``warm_s`` of warm-up."""
    _warm_up(fn, warm_s)
    return float(np.median([_once(fn) for _ in range(repeats)]))


def median_difference(fn: Any, base: Any, repeats: int, warm_s: float = WARM_S, tries: int = 3) -> float:
    """Median over ``repeats`` pairs of ``fn()``'s seconds less ``base()``'s, the two run in turn, each warmed up as
    ``median_seconds`` warms up: a slow spell of a shared machine then falls on both of a pair, where two medians
    taken one after the other carry it whole into their difference.

    ``fn`` does more than ``base`` by construction: a median at or under 0 is a spell that fell on ``base``'s runs
    of most pairs, so the pairs are timed again, up to ``tries`` times in all.
    """
    _warm_up(fn, warm_s)
    _warm_up(base, warm_s)
    median = 0.0
    for _ in range(tries):
        median = float(np.median([_once(fn) - _once(base) for _ in range(repeats)]))
        if median > 0:
            break
    return median


def _warm_up(fn: Any, warm_s: float) -> None:
    """Trace ``fn`` and run it 100 times or for ``warm_s``, each run waited for."""
    fn()
    began = timeit.default_timer()
    # TensorFlow's executor hands a kernel to its thread pool until the kernel's cost estimate has settled,
    # about 90 runs: a small layer measured before that pays a thread's wake-up per op. A call on a remote device
    # returns before it has run: each is waited for, or 100 queued in no time ran on within the first timed call
    # (1-2 s a size for each of AmoebaNet-D's cells on a worker)
    for _ in range(100):
        fn()
        tf.test.experimental.sync_devices()
        if timeit.default_timer() - began > warm_s:
            break


def _once(fn: Any) -> float:
    """Seconds of one run of ``fn()``, until every device has run it."""
    began = timeit.default_timer()
    fn()
    tf.test.experimental.sync_devices()
    return timeit.default_timer() - began


@tf.function
def _passed_through(inputs: Any) -> Any:
    return tf.nest.map_structure(tf.identity, inputs)


def _floats(inputs: Any) -> list[Any]:
    return [t for t in tf.nest.flatten(inputs) if t.dtype.is_floating]


def _loss_of(y: Any) -> tf.Tensor:
    parts = [tf.reduce_sum(tf.cast(t, tf.float32)) for t in tf.nest.flatten(y) if t.dtype.is_floating]
    return tf.add_n(parts) if parts else tf.constant(0.0)


class _Measured:
    """Built layer copies run in a chain, forward and forward-plus-backward, traced once for every batch size."""

    def __init__(self, copies: Sequence[Any], device: str):
        self._copies, self._device = list(copies), device
        self._forward = tf.function(self._chain, reduce_retracing=True)
        self._forward_backward = tf.function(self._gradients, reduce_retracing=True)
        self._held: tuple[float, float] | None = None  # counted in the forward and backward's trace (``counted``)
        self._forward_ops = 0  # the forward's ops in that trace (``ops``)

    def _chain(self, inputs: Any) -> Any:
        with cpu_gradients.scope(self._device):  # the gradients a cell on this device gets
            for copy in self._copies:
                inputs = copy(inputs, training=True)
        return inputs

    def _gradients(self, inputs: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(_floats(inputs))
            outputs = self._chain(inputs)
            loss = _loss_of(outputs)
        graph = tf.compat.v1.get_default_graph()
        forward_ops = len(graph.get_operations())
        self._forward_ops = _op_count(graph)
        grads = tape.gradient(loss, self._sources(inputs), unconnected_gradients=tf.UnconnectedGradients.ZERO)
        self._held = held_lib.counted(graph.get_operations(), forward_ops, tf.nest.flatten(outputs))
        return grads

    def _sources(self, inputs: Any) -> list[Any]:
        return [v.value for copy in self._copies for v in copy.trainable_variables] + _floats(inputs)

    def prime(self, x: Any) -> None:
        """Trace the forward general in the rows of ``x``: every size then runs that one trace."""
        self._forward.get_concrete_function(_general(x))

    def traced(self, x: Any) -> float:
        """Seconds the forward and backward take to trace (general in the rows of ``x``) and first run fed ``x``,
        beyond a later run."""
        began = timeit.default_timer()
        self._forward_backward.get_concrete_function(_general(x))
        self._forward_backward(x)
        tf.test.experimental.sync_devices()
        first = timeit.default_timer() - began
        began = timeit.default_timer()
        self._forward_backward(x)
        tf.test.experimental.sync_devices()
        return max(first - (timeit.default_timer() - began), 0.0)

    def seconds(
        self, x: Any, repeats: int, warm_s: float = WARM_S, forward_share: float | None = None
    ) -> tuple[float, float]:
        """(forward s, backward s) fed ``x``, each function warmed up for ``warm_s`` at most. Given a
        ``forward_share``, the forward is neither traced nor timed alone: that share of the forward and backward's."""
        # each measurement is one function call: take off what calling a function that does nothing costs, which
        # a cell's graph pays once per task, not once per layer
        call_s = median_seconds(lambda: _passed_through(x), repeats, warm_s)
        fb_s = max(median_seconds(lambda: self._forward_backward(x), repeats, warm_s) - call_s, 0.0)
        if forward_share is not None:
            return fb_s * forward_share, fb_s * (1.0 - forward_share)
        self.prime(x)  # traced general in the rows: every size runs that one trace
        f_s = max(median_seconds(lambda: self._forward(x), repeats, warm_s) - call_s, 0.0)
        return f_s, max(fb_s - f_s, 0.0)

    def ops(self, x: Any) -> tuple[int, int]:
        """(forward ops, backward ops) of the forward and backward's trace fed ``x`` (``traced`` first), split where
        the gradient begins (nested functions' ops counted)."""
        total = _op_count(self._forward_backward.get_concrete_function(_general(x)).graph)
        return self._forward_ops, max(total - self._forward_ops, 0)

    def counted(self, rows: int) -> float | None:
        """The bytes the backward reads of the forward at ``rows`` rows, counted in their trace (``traced`` first;
        ``planning.held``); None where they cannot be counted."""
        return None if self._held is None else self._held[1] + self._held[0] * rows

    def held(self, x: Any, memory: str) -> tuple[float, float]:
        """(bytes held, backward working bytes) fed ``x``, read from the allocator ``memory``."""
        # The forward run under a tape keeps what the backward will read (a traced function's outputs and the
        # intermediates its gradient needs); the tape's gradient then adds its working set.
        tf.config.experimental.reset_memory_stats(memory)
        base = tf.config.experimental.get_memory_info(memory)["current"]
        with tf.GradientTape() as tape:
            tape.watch(_floats(x))
            loss = _loss_of(self._forward(x))
        held = tf.config.experimental.get_memory_info(memory)["current"] - base
        tf.config.experimental.reset_memory_stats(memory)
        grads = tape.gradient(loss, self._sources(x), unconnected_gradients=tf.UnconnectedGradients.ZERO)
        tf.test.experimental.sync_devices()
        peak = tf.config.experimental.get_memory_info(memory)["peak"] - base
        del grads, tape, loss
        return float(max(held, 0)), float(max(peak - held, 0))


def _general(x: Any) -> Any:
    """Specs of the tensors ``x`` general in their rows: traced once so, a unit runs one trace at every size (a trace
    for one size, then one general, cost AmoebaNet-D's cells 0.7-1.3 s more each on a worker)."""
    return tf.nest.map_structure(lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), x)


def _op_count(graph: tf.Graph) -> int:
    """The ops of a graph and of the functions it calls."""
    defined = graph.as_graph_def()
    return len(defined.node) + sum(len(f.node_def) for f in defined.library.function)


def measure(
    units: Any,
    sample: Any,
    batch_sizes: Sequence[int],
    device: str,
    repeats: int = 5,
    progress: Progress | None = None,
    budget: float | None = None,
    auto_bound: Callable[[float], float] | None = None,
) -> Profile:
    """Profile ``units`` (``planning.units``: layers, or a Functional model's nodes) on ``device`` at each size in
    ``batch_sizes`` on data like ``sample``: each copied, run and traced once at the smallest size (at the largest, a
    walk went over a budget), then measured on its input's rows repeated to each size; bytes read on ``stand_in``.
    ``budget``: a size at which a unit alone is predicted to hold more is scaled from one run (``not_run``). Kept to
    ``progress``'s ``max_seconds`` (unset: to what ``auto_bound`` gives a one-device step of them) by ``_Tally``."""
    read_on = stand_in(device)
    memory = memory_name(read_on) if read_on else None
    sizes = sorted(set(int(b) for b in batch_sizes))
    by_batch = {b: LayerCosts([], [], [], []) for b in sizes}
    units = units_lib.of(units)
    nodes = isinstance(units, units_lib.Nodes)
    weights, trainable, tied = units_lib.weights(units) if nodes else ([], [], [])
    outputs: list[float] = []
    kinds: list[str | None] = []
    names = units_lib.names(units)
    known, bytes_notes = None, list[str]()  # on a stand-in, the bytes are read first: known at a size before it runs
    if read_on is not None and memory is not None and read_on != device:
        known, bytes_notes = _bytes_on(units, sample, sizes, read_on, memory, budget, progress, auto_bound)
    if progress is not None:
        progress.phase(f"measuring each of the {len(names)} layers alone at {len(sizes)} micro-batch sizes", len(names))
    scaled: dict[int, set[int]] = {}  # size -> the units scaled to it from a smaller size, not run (over budget)
    alike: dict[str, list[_Timed]] = {}  # kind -> its units timed: their costs, their tracing
    tally = _Tally(progress, len(names), sizes, by_batch, auto_bound)
    _pay_first_trace(device)
    for walked in units_lib.walk(units, sample, sizes[0], device):
        unit, began = len(outputs), timeit.default_timer()
        with _compat.custom_gradients_forgotten():  # the copy, let go after, holds no memory then
            kinds.append(same_layer_key(walked.copy, walked.inputs))
            timed = alike.setdefault(kinds[-1], []) if kinds[-1] is not None else []
            given = known[unit] if known is not None else None
            read = memory if read_on == device else None
            run = tally.sizes(len(timed), unread=known is not None and given is None)  # a stand-in left it unread
            per_size, over, trace_s, reused = _own_or_alike(walked, timed, given, run, device, read, repeats, budget)
        tally.took(unit, timeit.default_timer() - began, None if reused else run, trace_s)
        _record(by_batch, scaled, sizes, unit, per_size, over)
        if not nodes:  # a layer list's layers may be unbuilt: their built copies count
            weights.append(sum(tensor_bytes(v) for v in walked.copy.weights))
            trainable.append(sum(tensor_bytes(v) for v in walked.copy.trainable_variables))
        outputs.append(walked.crossing_bytes / sizes[0])
        if progress is not None:
            progress.step(names[unit])
    for costs in by_batch.values():
        tie_alike(costs, kinds)
    found = Profile(
        device, weights, trainable, tensor_bytes(tf.nest.map_structure(lambda t: np.asarray(t)[:1], sample)), outputs,
        by_batch, _source(read_on, device), read_on, tied=tied, trace_s=tally.traces,
        not_run=_scaled_notes(scaled, names) + bytes_notes + tally.notes(names),
    )  # fmt: skip
    found.time_source += tally.given()
    return found


def _bytes_deadline(progress: Progress | None, auto_bound: Callable[[float], float] | None) -> float:
    """When reading the units' bytes on a stand-in should end (a ``timeit`` time): ``BYTES_SHARE`` of the time left
    under ``max_seconds``, or under "auto" of the least bound ``auto_bound`` gives; inf without a bound."""
    if progress is None:
        return float("inf")
    left = progress.time_left()
    if not np.isfinite(left) and auto_bound is not None:
        left = auto_bound(0.0) - progress.seconds()
    return timeit.default_timer() + BYTES_SHARE * max(left, 0.0) if np.isfinite(left) else float("inf")


def _pay_first_trace(device: str) -> None:
    """Trace a throwaway layer's forward and backward on ``device``: a process's first such trace also pays costs
    paid once (0.16 s where a Dense(512)'s took 0.02), which would count to the first unit's ``Profile.trace_s``
    (and through its kind's mean to each unit of its kind: 12 x Dense(512)'s probes were predicted at 2-3.5x)."""
    with _compat.custom_gradients_forgotten():
        layer = keras.layers.Dense(1)
        layer.build((None, 1))
        _Measured([layer], device).traced(tf.ones((1, 1)))


_Costs = list[tuple[float, float, float, float]]  # per size: forward s, backward s, held bytes, working bytes
_Timed = tuple[_Costs, float]  # a unit's costs and the seconds it took to trace


def _own_or_alike(
    walked: Any,
    timed: list[_Timed],
    given: tuple[list[tuple[float, float]], set[int]] | None,
    sizes: _Sizes | None,
    device: str,
    read: str | None,
    repeats: int,
    budget: float | None,
) -> tuple[_Costs, list[int], float, bool]:
    """A unit's costs at each size, the sizes it is predicted over the budget at (scaled there, not run), its tracing
    seconds, and whether it took those of its kind's ``timed`` before it (``sizes`` None) rather than being timed."""
    if sizes is None:
        return _as_timed([costs for costs, _ in timed], given), [], float(np.mean([t for _, t in timed])), True
    per_size, over, trace_s = _unit_costs(walked, sizes, device, read, repeats, budget, given)
    timed.append((per_size, trace_s))
    return per_size, over, trace_s, False


def _record(
    by_batch: dict[int, LayerCosts],
    scaled: dict[int, set[int]],
    sizes: Sequence[int],
    unit: int,
    per_size: Sequence[tuple[float, float, float, float]],
    over: Sequence[int],
) -> None:
    """Add ``unit``'s costs at each of ``sizes`` to ``by_batch``; note in ``scaled`` the sizes it was scaled to."""
    for b, values in zip(sizes, per_size):
        _append(by_batch[b], *values)
    for b in over:
        scaled.setdefault(b, set()).add(unit)


def _source(read_on: str | None, device: str) -> str:
    """Where a profile's bytes come from: the device's allocator, a stand-in's, or the units' outputs."""
    if read_on is None:
        return FROM_OUTPUTS
    return MEASURED if read_on == device else f"{MEASURED} on {read_on}, this process's stand-in for {device}"


def _scaled_notes(scaled: dict[int, set[int]], names: Sequence[str]) -> list[str]:
    """``Profile.not_run``: at each size, the units not run alone there (predicted over the budget), scaled."""
    return [
        f"{len(units)} unit(s) alone at {b} samples not run (predicted over the budget alone): scaled from a smaller "
        f"size ({', '.join(names[u] for u in sorted(units)[:3])}{', ...' if len(units) > 3 else ''})"
        for b, units in sorted(scaled.items())
    ]


def _as_timed(timed: list[_Costs], known: tuple[list[tuple[float, float]], set[int]] | None) -> _Costs:
    """A unit's costs per size from the units of its kind ``timed`` before it: their mean, the bytes read for this
    unit where they were (``known``)."""
    mean = np.mean(np.asarray(timed, dtype=float), axis=0)
    if known is not None:
        return [(float(f), float(b), *known[0][j]) for j, (f, b, _, _) in enumerate(mean)]
    return [(float(f), float(b), float(h), float(w)) for f, b, h, w in mean]


def _bytes_on(
    units: Any,
    sample: Any,
    sizes: list[int],
    read_on: str,
    memory: str,
    budget: float | None,
    progress: Progress | None,
    auto_bound: Callable[[float], float] | None = None,
) -> tuple[list[tuple[list[tuple[float, float]], set[int]] | None], list[str]]:
    """Per unit, read on ``read_on`` (a device's stand-in): (held, working) bytes at each of ``sizes``, and the sizes
    over ``budget`` (predicted from the size before: scaled from it in proportion to the rows, not run), or None
    where it is left to be counted in its trace on the device (``_by_count``); and what the summary says of the units
    read at fewer sizes.

    A unit of a kind read before (``walk.same_layer_key``) gets that one's bytes: they hold the same tensors. Reading
    each of a 336-block Transformer's blocks at three sizes took 6 minutes on the client, before the planner's first
    probe. Where their pace says they would go past ``BYTES_SHARE`` of the time left (``_bytes_deadline``), later units
    are read at the middle size alone, or once ``COUNTED_FROM`` were read, not at all (``_BytesPace``).
    """
    names = units_lib.names(units)
    if progress is not None:
        progress.phase(f"reading each layer's bytes on {read_on}", len(names))
    # each copy traced once per size and called once: TensorFlow's warning about frequent tracing is not the user's
    logger, level = tf.get_logger(), tf.get_logger().level
    logger.setLevel(logging.ERROR)
    out: list[tuple[list[tuple[float, float]], set[int]] | None] = []
    read: dict[str, tuple[list[tuple[float, float]], set[int]]] = {}  # kind -> the first of its kind's bytes
    pace = _BytesPace(sizes, len(names), _bytes_deadline(progress, auto_bound))
    try:
        for i, walked in enumerate(units_lib.walk(units, sample, sizes[0], read_on)):
            kind = same_layer_key(walked.copy, walked.inputs)
            if kind is not None and kind in read:
                out.append((list(read[kind][0]), set(read[kind][1])))
            elif not (run := pace.sizes()):  # this one and the rest counted in their traces on the device instead
                out.extend([None] * (len(names) - i))  # (``_by_count``): the walk here ends
                break
            else:
                began = timeit.default_timer()
                with _compat.custom_gradients_forgotten():
                    got, over = _read_bytes(walked, sizes, run, read_on, memory, budget, pace.full)
                pace.took(i, timeit.default_timer() - began, run, got)
                out.append((got, over))
                if kind is not None:
                    read[kind] = (got, over)
            pace.done += 1
            if progress is not None:
                progress.step(names[i])
    finally:
        logger.setLevel(level)
    return out, pace.notes(names, read_on)


def _read_bytes(
    walked: Any,
    sizes: list[int],
    run: list[int],
    read_on: str,
    memory: str,
    budget: float | None,
    full: list[tuple[float, float]] | None,
) -> tuple[list[tuple[float, float]], set[int]]:
    """One walked unit's (held, working) bytes at each of ``sizes``, read at those in ``run`` (but those predicted
    over ``budget``), and the sizes over it. A size not read is scaled from the nearest read: as ``full`` (a unit
    read at every size) scales between the two, else in proportion to the rows."""
    measured, fixed = _Measured([walked.copy], read_on), _alone_bytes(walked)
    in_per_row = tensor_bytes(walked.inputs) / sizes[0]
    got: dict[int, tuple[float, float]] = {}
    over: set[int] = set()
    last, at = (0.0, 0.0), 0
    # Every size runs the trace general in the rows (a trace of 4 rows alone held half of that on AmoebaNet-D); under
    # a budget the smallest is read first, to predict the rest
    measured.prime(_rows(walked.inputs, sizes[0]))
    if run[0] != sizes[0] and budget is not None:
        run = [sizes[0], *run]
    for b in run:
        if at and _over_budget(fixed, in_per_row, sum(last) / at, b, budget):
            over.add(b)
            continue
        last, at = measured.held(_rows(walked.inputs, b), memory), b
        got[b] = last
    out = []
    for j, b in enumerate(sizes):
        if b in got:
            out.append(got[b])
            continue
        if b in over:  # over the budget before it was read: in proportion to the rows from the size read below it
            near = max(r for r in got if r < b)
            ratios = [b / near] * 2
        else:  # from the nearest size read, as the unit read at every size scales from there (else by the rows)
            near = min(got, key=lambda r: abs(np.log2(b / r)))
            k = sizes.index(near)
            ratios = [full[j][i] / full[k][i] if full is not None and full[k][i] > 0 else b / near for i in range(2)]
        held, working = got[near][0] * ratios[0], got[near][1] * ratios[1]
        if b > near and b not in over and _over_budget(fixed, in_per_row, (held + working) / b, b, budget):
            over.add(b)  # not read, but predicted over the budget: not run on the device either
        out.append((held, working))
    return out, over


class _BytesPace:
    """Which sizes ``_bytes_on`` reads the next unit at: every size while the units' pace keeps them within ``until``,
    else the middle one alone (the first unit read at every size), or none once ``COUNTED_FROM`` were read (what
    they hold per byte counted gives the rest), and what the summary says of those."""

    def __init__(self, sizes: list[int], units: int, until: float):
        self.every, self.units, self.until = sizes, units, until
        self.done = 0  # units done, those of a kind read before included
        self.full: list[tuple[float, float]] | None = None  # the last unit read at every size: its bytes
        self._each: list[float] = []  # per unit read: its seconds per size read
        self._fewer: list[int] = []  # the units read at the middle size alone

    def sizes(self) -> list[int]:
        """The sizes the next unit is read at."""
        if self.full is None or not np.isfinite(self.until):
            return list(self.every)
        share = len(self._each) / max(self.done, 1)  # of the units so far, those read (the rest took their kind's)
        left = self.until - timeit.default_timer()
        if (self.units - self.done) * share * float(np.mean(self._each)) * len(self.every) <= left:
            return list(self.every)
        return [] if len(self._each) >= COUNTED_FROM else [self.every[len(self.every) // 2]]

    def took(self, unit: int, seconds: float, run: list[int], got: list[tuple[float, float]]) -> None:
        """Count ``unit`` read at ``run`` in ``seconds`` (``got``: its bytes at every size)."""
        self._each.append(seconds / len(run))
        if len(run) == len(self.every):
            self.full = got
        else:
            self._fewer.append(unit)

    def notes(self, names: Sequence[str], read_on: str) -> list[str]:
        """What the summary says of the units read at the middle size alone."""
        if not self._fewer:
            return []
        return [
            f"{_listed(self._fewer, names)} read for their bytes on {read_on} at "
            f"{self.every[len(self.every) // 2]} of {self.every} rows only, to keep to {BYTES_SHARE:.0%} of the time "
            "left within max_seconds; the other sizes scaled as the layer read at every size before them"
        ]


def _over_budget(fixed: float, in_per_row: float, held_per_row: float, rows: int, budget: float | None) -> bool:
    """Whether a unit alone at ``rows`` rows is predicted over ``budget``: what it holds whatever its rows
    (``_alone_bytes``), and per row its input and the held and working bytes of the largest size run."""
    return budget is not None and fixed + (in_per_row + held_per_row) * rows > budget


def _alone_bytes(walked: Any) -> float:
    """What measuring a walked unit holds whatever its rows: its weights and their gradients, and its input and output
    at the walk's size (the rows it is measured on are repeated from them)."""
    copy = walked.copy
    weights = sum(tensor_bytes(v) for v in copy.weights) + sum(tensor_bytes(v) for v in copy.trainable_variables)
    return float(weights + tensor_bytes(walked.inputs) + tensor_bytes(walked.outputs))


def _unit_costs(
    walked: Any,
    run: _Sizes,
    device: str,
    memory: str | None,
    repeats: int,
    budget: float | None,
    known: tuple[list[tuple[float, float]], set[int]] | None = None,
) -> tuple[_Costs, list[int], float]:
    """One walked unit's (forward s, backward s, held bytes, working bytes) at each of ``run.every`` (``measure``'s),
    the sizes not run because the unit alone is predicted over ``budget`` there (scaled from the largest size run),
    and the seconds its forward and backward took to trace at the smallest size. Sizes outside ``run.sizes`` are not
    run (to keep to ``max_seconds``): ``run.scaled`` gives them from those run.

    Bytes are read from ``memory`` (the device's allocator), or ``known`` (read on a stand-in, with the sizes over the
    budget there), or else estimated from the unit's output.
    """
    sizes = run.every
    x_in, measured = walked.inputs, _Measured([walked.copy], device)
    fixed, in_per_row = _alone_bytes(walked), tensor_bytes(x_in) / sizes[0]
    out_per_row = tensor_bytes(walked.outputs) / sizes[0]
    costs: dict[int, tuple[float, float, float, float]] = {}
    over: list[int] = []
    ran: tuple[int, float, float, float, float] | None = None  # the largest size run: b, f_s, b_s, held, working
    trace_s = measured.traced(_rows(x_in, sizes[0]))
    known = _given_bytes(measured, run, known, walked, fixed, in_per_row, budget)
    run.count(measured.ops(_rows(x_in, run.sizes[0])))  # where the forward first runs: traced there
    for b in run.sizes:
        if known is not None:
            too_many = b in known[1]
        else:
            too_many = ran is not None and _over_budget(fixed, in_per_row, sum(ran[3:]) / ran[0], b, budget)
        if too_many and ran is not None:
            f_s, b_s, held, working = (value * b / ran[0] for value in ran[1:])
            costs[b] = (f_s, b_s, held, working)  # the bytes read on a stand-in replace these below
            over.append(b)
            continue
        f_s, b_s = measured.seconds(_rows(x_in, b), repeats, run.warm_s, run.timed_share())
        if known is not None:
            held, working = known[0][sizes.index(b)]
        elif memory is not None:
            held, working = measured.held(_rows(x_in, b), memory)
            if run.counted is not None and (count := measured.counted(b)):
                run.counted.add(b, count, held, working, _grads(walked))
        else:
            # Without an allocator that counts, a unit is taken to hold its output and as much again inside (a Dense'
            # pre-activation, a normalization's statistics): a rough rule, said so
            held = working = 2.0 * out_per_row * b
        ran = (b, f_s, b_s, held, working)
        costs[b] = (f_s, b_s, held, working)
    scaled = run.scaled(costs)
    if known is not None:  # read at every size on the stand-in (or counted): those bytes, whatever was run here
        scaled = [(f_s, b_s, *known[0][j]) for j, (f_s, b_s, _, _) in enumerate(scaled)]
    return scaled, over, trace_s


class _Counted:
    """What the units whose bytes were read showed per byte counted in their traces (``planning.held``), by size:
    what a unit whose bytes are not read is given (``_by_count``)."""

    def __init__(self) -> None:
        self._read: dict[int, list[tuple[float, float]]] = {}  # rows -> per unit read: (held, working) per counted

    def add(self, rows: int, count: float, held: float, working: float, grads: float) -> None:
        """Note a unit's bytes read at ``rows`` against its ``count``: its working bytes less its weights'
        gradients (``grads``), which do not go by the rows."""
        self._read.setdefault(rows, []).append((held / count, max(working - grads, 0.0) / count))

    def ratios(self, rows: int) -> tuple[float, float] | None:
        """(held, working less gradients) bytes per counted byte: the median over the units read at the size nearest
        ``rows`` that ``COUNTED_FROM`` were read at (one unit's read at one size can be far off: 0 to 2.4x the count
        at 1-4 rows of an AmoebaNet-D cell); None before any size was."""
        enough = [r for r, read in self._read.items() if len(read) >= COUNTED_FROM]
        if not enough:
            return None
        near = min(enough, key=lambda r: abs(np.log2(rows / r)))
        held, working = np.median(np.asarray(self._read[near]), axis=0)
        return float(held), float(working)


def _grads(walked: Any) -> float:
    """The bytes of a walked unit's weights' gradients: in its backward's working bytes, whatever the rows."""
    return float(sum(tensor_bytes(v) for v in walked.copy.trainable_variables))


def _given_bytes(
    measured: _Measured,
    run: _Sizes,
    known: tuple[list[tuple[float, float]], set[int]] | None,
    walked: Any,
    fixed: float,
    in_per_row: float,
    budget: float | None,
) -> tuple[list[tuple[float, float]], set[int]] | None:
    """A unit's bytes at every size and the sizes over the budget, where it is not to be read on its device: read on
    a stand-in (``known``, noted in ``run.counted`` against its count), or by its count where ``run.by_count``."""
    if known is None:
        return _by_count(measured, run, _grads(walked), fixed, in_per_row, budget) if run.by_count else None
    if run.counted is not None:
        grads = _grads(walked)
        for j, b in enumerate(run.every):
            if b not in known[1] and (count := measured.counted(b)):
                run.counted.add(b, count, *known[0][j], grads)
    return known


def _by_count(
    measured: _Measured, run: _Sizes, grads: float, fixed: float, in_per_row: float, budget: float | None
) -> tuple[list[tuple[float, float]], set[int]] | None:
    """A unit's (held, working) bytes at each of ``run.every`` not read but given: its count there times what the
    units read showed per counted byte (``run.counted``; its weights' gradients ``grads`` added to its working
    bytes), and the sizes that puts it over ``budget`` at; None where it has no count or too few units were read."""
    out: list[tuple[float, float]] = []
    over: set[int] = set()
    for b in run.every:
        count, ratios = measured.counted(b), run.counted.ratios(b) if run.counted is not None else None
        if not count or ratios is None:
            return None
        held, working = count * ratios[0], grads + count * ratios[1]
        if _over_budget(fixed, in_per_row, (held + working) / b, b, budget):
            over.add(b)
        out.append((held, working))
    run.given_by_count = True
    return out, over


@dataclasses.dataclass
class _Sizes:
    """The sizes a unit is measured at: ``sizes`` of ``every`` (all of them unless ``_Tally`` keeps to a bound).

    A size not run between two run is interpolated between them, times in log(size) and log(time), bytes in the rows
    (as ``fill`` does). Where one size alone was run, its times elsewhere are a line in the rows through it: a part
    that does not scale, the unit's ``ops`` (set when it is measured) times ``fixed`` (per forward and backward op, of
    the units timed at several sizes together; at most ``FIXED_SHARE`` of its time), the rest in proportion to the
    rows; its bytes by the rows. A unit to be timed at one size whose ops are more than ``LINED_OPS`` times
    ``typical_ops`` (of those the fixed part comes from) is timed at the smallest and the largest instead (``count``),
    and joins them. ``warm_s``: each timed function's warm-up, at most. Timed at one size, its forward is not timed
    alone: it takes ``forward_share`` of its forward and backward (``timed_share``). Bytes read are noted in
    ``counted`` against the bytes counted in the unit's trace; where ``by_count``, they are given from it instead
    (``_by_count``: then ``given_by_count``).
    """

    every: list[int]
    sizes: list[int] = dataclasses.field(default_factory=list)
    fixed: tuple[float, float] = (0.0, 0.0)
    warm_s: float = WARM_S
    ops: tuple[int, int] = (0, 0)
    typical_ops: float = float("inf")
    counted: _Counted | None = None
    by_count: bool = False
    given_by_count: bool = False
    forward_share: float | None = None

    def timed_share(self) -> float | None:
        """The forward's share its forward and backward's time is split by, where it is timed at one size alone."""
        return self.forward_share if len(self.sizes) == 1 else None

    def __post_init__(self) -> None:
        self.sizes = self.sizes or list(self.every)

    def count(self, ops: tuple[int, int]) -> None:
        """Take the unit's forward and backward ``ops``, counted once it is traced and before it is timed."""
        self.ops = ops
        if len(self.sizes) == 1 and sum(ops) > LINED_OPS * self.typical_ops:
            self.sizes = _ends(self.every)

    def scaled(self, costs: dict[int, tuple[float, float, float, float]]) -> _Costs:
        """``costs`` by size run, with each size not run interpolated or scaled from those run."""
        out: _Costs = []
        for b in self.every:
            below, above = [r for r in costs if r < b], [r for r in costs if r > b]
            if b in costs:
                out.append(costs[b])
            elif below and above:
                ends = [max(below), min(above)]
                f_s, b_s, held, working = (
                    _interpolated(b, ends, [costs[r][i] for r in ends], times=i < 2) for i in range(4)
                )
                out.append((f_s, b_s, held, working))
            else:
                near = min(costs, key=lambda r: abs(np.log2(b / r)))
                f_s, b_s, held, working = costs[near]
                forward, backward = (
                    _through(seconds, per_op * ops, near, b)
                    for seconds, per_op, ops in zip((f_s, b_s), self.fixed, self.ops)
                )
                out.append((forward, backward, held * b / near, working * b / near))
        return out


def _ends(sizes: list[int]) -> list[int]:
    """The smallest and the largest of ``sizes``."""
    return sorted({sizes[0], sizes[-1]})


def _through(seconds: float, fixed: float, rows: int, b: int) -> float:
    """A time run at ``rows`` given at ``b`` rows: ``fixed`` of it (at most ``FIXED_SHARE``) whatever the rows, the
    rest in proportion to them."""
    fixed = min(fixed, FIXED_SHARE * seconds)
    return fixed + (seconds - fixed) * b / rows


_ONE_SIZE = "the other sizes by the rows beyond a fixed part per op, of the layers timed at several sizes"


class _Tally:
    """The units ``measure`` has done: their tracing, which took their kind's times, which were measured at which
    sizes; and from their pace, the sizes the next is measured at so that the layers alone keep to ``LAYERS_SHARE`` of
    the time left under ``max_seconds`` when they start (unset: of what ``auto_bound`` gives the one-device step those
    done extrapolate to, ``_deadline``): every size while their pace allows, then the smallest and the
    largest (the middle interpolated, as the search's other sizes are), then the middle one alone. The first unit
    timed is measured at every size (``_Sizes``: how the sizes not run are given)."""

    def __init__(
        self,
        progress: Progress | None,
        units: int,
        sizes: list[int],
        by_batch: dict[int, LayerCosts],
        auto_bound: Callable[[float], float] | None = None,
    ):
        left = progress.time_left() if progress is not None else float("inf")
        self._began, self._elapsed = timeit.default_timer(), progress.seconds() if progress is not None else 0.0
        self._until = self._began + LAYERS_SHARE * left if np.isfinite(left) else float("inf")
        self._auto = auto_bound if progress is not None and not np.isfinite(left) else None
        self._units, self._every, self._by_batch = units, sizes, by_batch
        self._done, self.copied = 0, 0  # units done; of them, given the times of those of their kind before them
        self.pressed = False  # whether one was given its kind's first's times alone, to keep to the bound
        self.traces: list[float] = []  # per unit: its tracing seconds (``Profile.trace_s``)
        self._each: list[float] = []  # per unit timed: its seconds per size run, its tracing counted as one size
        self._lined: list[int] = []  # the units timed at several sizes: what a unit timed at one is scaled by
        self._lined_ops = [0, 0]  # their forward and backward ops
        self._fewer: dict[tuple[int, ...], list[int]] = {}  # sizes run -> the units measured at them alone
        self._counted = _Counted()  # the bytes read per byte counted, for the units whose bytes go by count
        self._by_count: list[int] = []  # the units given their bytes by their count

    def sizes(self, of_kind: int, unread: bool = False) -> _Sizes | None:
        """The sizes the next unit is measured at, with the ratios the others are scaled by; None where it takes the
        times of the ``of_kind`` units of its kind timed before it (``ALIKE_TIMED``; under pressure, one). Its bytes
        go by its count where it is pressed to fewer sizes or ``unread`` (left so by a stand-in)."""
        every = self._every
        if of_kind >= ALIKE_TIMED:
            return None
        until = self._deadline()
        if not np.isfinite(until) or not self._lined:
            return _Sizes(every, counted=self._counted, by_count=unread)
        choices = [every, _ends(every), [every[len(every) // 2]]]
        share = len(self._each) / self._done  # of the units so far, those timed (the rest took their kind's)
        each, left = float(np.mean(self._each)), until - timeit.default_timer()
        fitting = [c for c in choices if (self._units - self._done) * share * each * (1 + len(c)) <= left]
        chosen = fitting[0] if fitting else choices[-1]
        if len(chosen) == len(every):
            return _Sizes(every, counted=self._counted, by_count=unread)
        if of_kind:
            self.pressed = True
            return None
        typical = sum(self._lined_ops) / len(self._lined)
        return _Sizes(
            every, list(chosen), self._fixed_per_op(), PRESSED_WARM_S, typical_ops=typical, counted=self._counted,
            by_count=True, forward_share=self._forward_share(),
        )  # fmt: skip

    def _forward_share(self) -> float:
        """Of the units timed at several sizes, their forwards' share of their summed forward and backward seconds."""
        forward, backward = np.sum([_times_of(self._by_batch, self._every, unit) for unit in self._lined], axis=(0, 2))
        return float(forward / (forward + backward)) if forward + backward > 0 else 0.5

    def _fixed_per_op(self) -> tuple[float, float]:
        """Of the units timed at several sizes together, the forward and backward seconds per op that do not scale with
        the rows: their summed times' least-squares line in the rows at 0 rows (within 0 and their sum at the fewest),
        over their ops. Together: one unit's times on a worker move by a millisecond run to run."""
        every, fixed = self._every, []
        summed = np.sum([_times_of(self._by_batch, every, unit) for unit in self._lined], axis=0)  # forward, backward
        for times, ops in zip(summed, self._lined_ops):
            at_zero = float(np.polyfit(every, times, 1)[1])
            fixed.append(min(max(at_zero, 0.0), float(times.min())) / ops if ops > 0 else 0.0)
        return fixed[0], fixed[1]

    def _deadline(self) -> float:
        """When the layers' share of the bound ends: ``max_seconds``', or the one ``auto_bound`` gives for the step of
        all the units on one device that those done so far extrapolate to (their times at the largest size)."""
        if self._auto is None or not self._done:
            return self._until
        largest = self._by_batch[self._every[-1]]
        done = sum(largest.forward_s[: self._done]) + sum(largest.backward_s[: self._done])
        return self._began + LAYERS_SHARE * (self._auto(done * self._units / self._done) - self._elapsed)

    def took(self, unit: int, seconds: float, run: _Sizes | None, trace_s: float) -> None:
        """Count ``unit`` done in ``seconds``, measured at ``run`` (None: given its kind's times), traced in
        ``trace_s``."""
        self._done += 1
        self.traces.append(trace_s)
        if run is None:
            self.copied += 1
            return
        self._each.append(seconds / (1 + len(run.sizes)))
        if len(run.sizes) > 1:
            self._lined.append(unit)
            self._lined_ops = [ops + more for ops, more in zip(self._lined_ops, run.ops)]
        if len(run.sizes) < len(self._every):
            self._fewer.setdefault(tuple(run.sizes), []).append(unit)
        if run.given_by_count:
            self._by_count.append(unit)

    def given(self) -> str:
        """What the profile's time source says of the units given their kind's times ("" where none was)."""
        if not self.copied:
            return ""
        pressed = ", or of the first alone to keep to max_seconds" if self.pressed else ""
        return f" ({self.copied} given the times of the first {ALIKE_TIMED} of their kind{pressed})"

    def notes(self, names: Sequence[str]) -> list[str]:
        """What the summary says of the units measured at fewer sizes, and of those given their bytes by count."""
        notes = [
            f"{_listed(units, names)} measured alone at {list(run)} of {self._every} rows only, to keep the layers to "
            f"{LAYERS_SHARE:.0%} of the time left within max_seconds; "
            + ("the sizes between interpolated" if len(run) > 1 else _ONE_SIZE)
            for run, units in self._fewer.items()
        ]
        if self._by_count:
            notes.append(
                f"{_listed(self._by_count, names)}' bytes not read (to keep to max_seconds): the tensors their "
                "backward reads, counted in their traces, times what the layers read before showed per counted byte"
            )
        return notes


def _listed(units: Sequence[int], names: Sequence[str]) -> str:
    """``units`` as the summary names them: their count and the first three's names."""
    return f"{len(units)} layer(s) ({', '.join(names[u] for u in units[:3])}{', ...' if len(units) > 3 else ''})"


def _times_of(by_batch: dict[int, LayerCosts], sizes: Sequence[int], unit: int) -> tuple[list[float], list[float]]:
    """``unit``'s forward and its backward seconds at each of ``sizes``."""
    return [by_batch[b].forward_s[unit] for b in sizes], [by_batch[b].backward_s[unit] for b in sizes]


def _append(costs: LayerCosts, forward_s: float, backward_s: float, held: float, working: float) -> None:
    costs.forward_s.append(forward_s)
    costs.backward_s.append(backward_s)
    costs.held_bytes.append(held)
    costs.working_bytes.append(working)


def tie_alike(costs: LayerCosts, kinds: Sequence[str | None]) -> None:
    """Give layers of the same kind their mean forward and backward times.

    Alike layers do the same work, but each is timed alone for well under a millisecond at small micro-batches:
    on a worker, 12 Dense(512) at 16 rows measured 0 to 0.25 ms forward each, and the plan cut them 7-5. The mean
    keeps the layers' total.
    """
    groups: dict[str, list[int]] = {}
    for i, kind in enumerate(kinds):
        if kind is not None:
            groups.setdefault(kind, []).append(i)
    for members in groups.values():
        for times in (costs.forward_s, costs.backward_s):
            mean = float(np.mean([times[i] for i in members]))
            for i in members:
                times[i] = mean


def _rows(x: Any, n: int) -> Any:
    """``x`` (a walk's tensors) with its rows repeated to ``n``."""

    def repeated(t: Any) -> Any:
        reps = -(-n // int(t.shape[0]))
        with tf.device(t.device):  # where the walk left it: the unit's device
            return tf.concat([t] * reps, 0)[:n] if reps > 1 else t[:n]

    return tf.nest.map_structure(repeated, x)


def _interpolated(b: int, sizes: Sequence[int], values: Any, times: bool) -> float:
    """``values`` at the sorted ``sizes``, interpolated to ``b``: times in log(size) and log(time), bytes linearly in
    the size (activations grow with the rows)."""
    if times:
        return float(np.exp2(np.interp(np.log2(b), np.log2(sizes), np.log2(np.maximum(values, 1e-12)))))
    return float(np.interp(b, sizes, values))


def fill(profile: Profile, sizes: Sequence[int]) -> None:
    """Add every size in ``sizes`` not measured, interpolated between the measured ones (per layer).

    Times are interpolated in log(size) and log(time); bytes linearly in the size (activations grow with the rows).
    Outside the measured range the nearest measured size's values are scaled (times and bytes by the size ratio).
    """
    measured = sorted(profile.by_batch)
    for b in sorted(set(sizes) - set(measured)):
        entry = LayerCosts([], [], [], [])
        for field in ("forward_s", "backward_s", "held_bytes", "working_bytes"):
            columns = np.array([getattr(profile.by_batch[m], field) for m in measured])  # sizes x layers
            values = np.array([_interpolated(b, measured, col, field.endswith("_s")) for col in columns.T])
            nearest = min(max(b, measured[0]), measured[-1])
            if b != nearest:  # outside: proportional to the rows
                values = columns[measured.index(nearest)] * b / nearest
            getattr(entry, field).extend(float(v) for v in values)
        profile.by_batch[b] = entry


def rescale(profile: Profile, batch: int, seconds: float) -> None:
    """Scale the layers' forward and backward times at ``batch`` so that together they take ``seconds``."""
    costs = profile.costs(batch)
    total = sum(costs.forward_s) + sum(costs.backward_s)
    if total > 0:
        costs.forward_s[:] = [t * seconds / total for t in costs.forward_s]
        costs.backward_s[:] = [t * seconds / total for t in costs.backward_s]


def sample_of(layers: Any, sample: Any, input_shape: Any) -> Any:
    """One batch to profile with: ``sample`` as given, else data generated for ``input_shape`` or the model's input."""
    if sample is not None:
        cost_lib.batch_size(sample)  # a ValueError unless it is a batch
        return sample
    if input_shape is None and functional.is_functional(layers):  # its inputs' specs, a sequence length filled in
        try:
            return specs.estimation_sample(layers.input, 1, 1, hub.stand_in_length(layers))
        except ValueError:
            pass  # a dimension left unknown: the error below asks for a sample
    elif input_shape is None and isinstance(layers, keras.Model):
        try:
            input_shape = tuple(layers.inputs[0].shape) if len(layers.inputs) == 1 else None
        except (AttributeError, ValueError):
            input_shape = None
    if input_shape is None:
        raise ValueError(
            "The planner measures every layer on data shaped like the model's input: pass sample=<one batch of "
            "inputs> or input_shape=(None, ...) (the shape of one batch, e.g. (None, 128))."
        )
    shape = tuple(input_shape)
    spec = specs.symbolic((None,) + shape[1:])
    return specs.estimation_sample(spec, 1, 1)
