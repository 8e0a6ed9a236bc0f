"""The pipeline schedule as plain data: which task each device runs, in which order.

Four schedules put one cell on each device:

- ``"gpipe"``: every cell runs all its forwards, then all its backwards (last
  micro-batch first); a cell holds the activations of all M micro-batches. Bubble
  (K-1)/(M+K-1).
- ``"1f1b"`` (PipeDream-flush, Narayanan et al. 2021): cell i runs min(K-i, M)
  forwards, then alternates one backward and one forward, then drains its
  backwards (first micro-batch first); a cell holds at most K-i micro-batches.
  Same bubble as GPipe.
- ``"zero_bubble"`` (ZB-H1, Qi et al. 2024): 1F1B's order with each backward split
  in two, B (the gradient of the cell's input, which the previous cell waits for)
  and W (the gradient of its weights, which nobody waits for). Cell i runs W(i, j)
  after B(i, j + i), and its last i W tasks after its last B: they fill the time
  1F1B's cell i would wait at the end of the step. A cell holds at most K
  micro-batches (their activations live until W); the bubble per device is
  (K-1)(F+B-W) instead of 1F1B's (K-1)(F+B+W).
- ``"gpipe_batched_w"``: GPipe's order with each backward split the same way, and
  each cell's W run once, after its last B, over all M micro-batches together
  (``W(i, all)``): one weight-gradient product over the whole mini-batch instead of M
  small ones (the cell's activations and output gradients of every micro-batch are
  held until then). Cell i's W fills the time it would wait for cell 0 to finish.

Five put v = N/K of the N cells on each of K devices (``SHARED_SCHEDULES``; ``placement`` says where), so
that a micro-batch passes each device v times and the bubble shrinks to about (K-1)/(vM+K-1):

- ``"interleaved_1f1b"`` (Megatron-LM's virtual pipeline stages, Narayanan et al. 2021): cell c on device
  c mod K. Micro-batches go in groups of K: a device runs a group's forwards through its first cell, then its
  second, and so on, and the backwards likewise with its cells in reverse; (v-1)K + 2(K-1-d) forwards ahead
  (device d), then one forward and one backward in turn. A device holds more micro-batches than under 1F1B,
  each of a cell 1/v of its layers.
- ``"looped_bfs"`` (breadth first, Lamy-Poirier 2023): the same placement; a device runs every forward of
  its first cell, then of its second, ..., then every backward, its last cell first. GPipe's memory.
- ``"interleaved_zero_bubble"``: interleaved 1F1B's order with each backward split into B and W, device d
  running each W d backwards after its B (as zero bubble's cell i does i).
- ``"zbv"`` (ZB-V, Qi et al. 2024): 2K cells in a V, cells d and 2K-1-d on device d, so the last cell (and the
  loss) is on device 0 next to the first. Backwards split into B and W; each device's order is found by
  playing the step out with equal task times, running a ready B first, then a forward while the device
  holds fewer than 2K micro-batches of a cell (1F1B's memory: K micro-batches of the device's layers), then
  a W, which fills the waits.
- ``"dualpipev"`` (DualPipeV: DeepSeek-V3's DualPipe folded into a V, as torch's ``ScheduleDualPipeV``): ZB-V's
  placement; after the warm-up a device runs a forward of one of its cells and a whole backward of the other in
  turn (DualPipe overlaps each such pair on a GPU), splitting backwards into B and W only while the pipeline
  fills and drains (``_dualpipev``). M >= 2K - 1.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Collection, Sequence
from typing import Any

from tfpipe._args import positive_int

ALL = -1  # the micro-batch of a W task over all micro-batches at once ("gpipe_batched_w")


@dataclasses.dataclass(frozen=True)
class Task:
    """One unit of work of one cell on one micro-batch: forward "F", backward "B" or, split off it, "W".

    Without W tasks, B is the cell's whole backward. With them (zero bubble), B computes
    only the gradient of the cell's inputs and W that of its weights; a W task whose
    micro-batch is ``ALL`` computes them over every micro-batch at once.
    """

    kind: str
    cell: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}({self.cell},{micro_batch_name(self.micro_batch)})"


def micro_batch_name(micro_batch: int) -> str:
    """How a task's micro-batch is written in names: its number, or "all" for ``ALL``."""
    return "all" if micro_batch == ALL else str(micro_batch)


def gpipe(num_cells: int, num_micro_batches: int, backward: bool = True) -> list[list[Task]]:
    """GPipe's clock cycles: each cycle lists the tasks that may run at the same time.

    Forward: at cycle k, cell i runs micro-batch k - i. Backward mirrors it: cell
    K-1 starts with micro-batch M-1, and cell i runs B(i, j) at backward cycle
    (K-1-i) + (M-1-j).
    """
    positive_int("num_cells", num_cells)
    positive_int("num_micro_batches", num_micro_batches)
    k_cells, m = num_cells, num_micro_batches
    cycles = []
    for clock in range(m + k_cells - 1):
        cycles.append([Task("F", i, clock - i) for i in range(k_cells) if 0 <= clock - i < m])
    if backward:
        for clock in range(m + k_cells - 1):
            tasks = []
            for i in reversed(range(k_cells)):
                j = (m - 1) - (clock - (k_cells - 1 - i))
                if 0 <= j < m:
                    tasks.append(Task("B", i, j))
            cycles.append(tasks)
    return cycles


SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "gpipe_batched_w")  # one cell per device
SHARED_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev")  # v a device
V_SCHEDULES = ("zbv", "dualpipev")  # two cells a device in a V
ALL_SCHEDULES = SCHEDULES + SHARED_SCHEDULES


def check_name(name: Any) -> str:
    """Validate a schedule: a name of ``ALL_SCHEDULES``, or one written as data (``written``), returned as its text."""
    if isinstance(name, str) and name in ALL_SCHEDULES:
        return name
    if isinstance(name, (list, tuple)) or (isinstance(name, str) and any(c in name for c in "(, \n")):
        return written(name)
    raise ValueError(
        f"Unknown schedule={name!r}; use one of {', '.join(repr(s) for s in ALL_SCHEDULES)}, or write one as a list "
        "of each device's tasks (tfpipe.schedule.written)."
    )


_OURS = re.compile(r"([FBW])\((\d+),(\d+)\)")  # "F(0,1)": as Task prints
_TORCHS = re.compile(r"(\d+)([FBIW])(\d+)")  # "0F1": torch's action string (I: the input gradient, B when split)
_TOKEN = re.compile(r"[A-Za-z]\s*\([^)]*\)|[^\s,]+")  # a task of a line of text: "F(0, 1)", "0F1"


def written(orders: Any) -> str:
    """A schedule written as data, as the text tfpipe carries, saves and shows: a line per device, tasks by spaces.

    ``orders`` holds each device's tasks in the order it runs them: tasks as tfpipe prints them ("F(0,1)",
    "B(2,0)", "W(1,3)"), torch's action strings ("0F1"; "2I0" or "2B0" for a B, "1W3") or ``Task``s; or it is
    that text. Device d runs the tasks of the cells it lists; a cell's W tasks split its backward as zero bubble
    does. ``PipelineModel(schedule=orders)`` checks that every task is there once and that the orders do not
    deadlock (``check_written``) before anything is traced.
    """
    if isinstance(orders, str):
        return _written_text(orders)
    if isinstance(orders, (list, tuple)) and all(isinstance(row, (list, tuple)) for row in orders) and orders:
        rows = [list(row) for row in orders]
    else:
        raise TypeError(
            f"A written schedule is a list of each device's tasks, e.g. [['F(0,0)', 'B(0,0)'], ['F(1,0)', "
            f"'B(1,0)']]; got {orders!r:.100}."
        )
    return _canonical(rows)


@functools.lru_cache(maxsize=64)
def _written_text(text: str) -> str:
    """``written`` of a text (every step's checks ask again: parsed once)."""
    return _canonical([_TOKEN.findall(line) for line in text.strip().splitlines()])


def _canonical(rows: list[Any]) -> str:
    """``written``'s text of each device's tasks ``rows``, or a ValueError naming the first that is not a task."""
    lines = []
    for d, row in enumerate(rows):
        tasks = []
        for n, item in enumerate(row):
            task = item if isinstance(item, Task) else _parse_task(str(item))
            if task is None:
                raise ValueError(
                    f"The written schedule's device {d}, task {n}: {item!r} is not a task; write "
                    "'F(cell,micro_batch)', 'B(...)' or 'W(...)' as tfpipe prints them, or torch's '0F1' (I for B)."
                )
            tasks.append(str(task))
        lines.append(" ".join(tasks))
    return "\n".join(lines)


def _parse_task(text: str) -> Task | None:
    """A task from tfpipe's "F(0,1)" or torch's "0F1"; None if ``text`` is neither."""
    text = re.sub(r"\s", "", text)
    ours = _OURS.fullmatch(text)
    if ours:
        return Task(ours.group(1), int(ours.group(2)), int(ours.group(3)))
    theirs = _TORCHS.fullmatch(text)
    if theirs:
        return Task({"I": "B"}.get(theirs.group(2), theirs.group(2)), int(theirs.group(1)), int(theirs.group(3)))
    return None


def is_written(name: str) -> bool:
    """Whether ``name`` is a schedule written as data (``written``'s text), not one of ``ALL_SCHEDULES``."""
    return name not in ALL_SCHEDULES


def label(name: str) -> str:
    """How a summary names schedule ``name``: its name in quotes, or "a written schedule on K devices"."""
    return f"a written schedule on {written_devices(name)} devices" if is_written(name) else repr(name)


def written_devices(text: str) -> int:
    """The devices a written schedule (``written``'s text) runs on: one per line."""
    return len(_orders_of(text))


@functools.lru_cache(maxsize=64)
def _orders_of(text: str) -> tuple[tuple[Task, ...], ...]:
    """Each device's tasks of a written schedule's text (``written``'s, or any text ``written`` reads)."""
    lines = _written_text(text).splitlines()  # every token of which is a task
    return tuple(tuple(task for t in line.split() if (task := _parse_task(t)) is not None) for line in lines)


@functools.lru_cache(maxsize=64)
def check_written(text: str, num_cells: int, num_micro_batches: int) -> str:
    """``text`` (``written``'s) if it runs every task of ``num_cells`` cells on M micro-batches once, each cell on one
    device, without deadlock; else a ValueError that names the first bad task."""
    orders = _orders_of(text)
    device: dict[int, int] = {}
    seen: dict[Task, int] = {}
    for d, order in enumerate(orders):
        for task in order:
            if not (0 <= task.cell < num_cells and 0 <= task.micro_batch < num_micro_batches):
                raise ValueError(
                    f"The written schedule's {task} (device {d}) is out of range: the model has {num_cells} cells "
                    f"(0-{num_cells - 1}) and {num_micro_batches} micro-batches (0-{num_micro_batches - 1})."
                )
            if device.setdefault(task.cell, d) != d:
                raise ValueError(
                    f"The written schedule's {task} is on device {d}, but cell {task.cell}'s first task is on device "
                    f"{device[task.cell]}: every task of a cell runs on the device that holds its weights."
                )
            if task in seen:
                raise ValueError(f"The written schedule runs {task} twice (devices {seen[task]} and {d}).")
            seen[task] = d
    split = {task.cell for task in seen if task.kind == "W"}
    kinds = "FBW" if split else "FB"
    for cell in range(num_cells):
        for kind in kinds:
            for j in range(num_micro_batches):
                if Task(kind, cell, j) not in seen:
                    why = " (its W tasks split the backward of every cell)" if kind == "W" else ""
                    raise ValueError(f"The written schedule lacks {Task(kind, cell, j)}{why}.")
    merge(orders)  # a ValueError naming the tasks that wait on each other
    return text


def splits_backward(name: str) -> bool:
    """Whether schedule ``name`` splits each backward into B (input gradient) and W (weight gradient) tasks."""
    if is_written(check_name(name)):
        return any(task.kind == "W" for order in _orders_of(name) for task in order)
    return name in ("zero_bubble", "gpipe_batched_w", "interleaved_zero_bubble", "zbv", "dualpipev")


def batches_weights(name: str) -> bool:
    """Whether schedule ``name`` runs each cell's W once over all micro-batches (``Task("W", i, ALL)``)."""
    return check_name(name) == "gpipe_batched_w"


def shares_devices(name: str) -> bool:
    """Whether schedule ``name`` lays its cells over devices its own way (``SHARED_SCHEDULES``, or written)."""
    return check_name(name) in SHARED_SCHEDULES or is_written(name)


def least_micro_batches(name: str, num_devices: int) -> int:
    """The fewest micro-batches schedule ``name`` runs on ``num_devices`` devices: 2K - 1 for DualPipeV, else 1."""
    return 2 * num_devices - 1 if check_name(name) == "dualpipev" else 1


def check_micro_batches(name: str, num_micro_batches: int, num_devices: int) -> int:
    """``num_micro_batches``, or a ValueError where schedule ``name`` needs more on ``num_devices`` devices."""
    least = least_micro_batches(name, num_devices)
    if num_micro_batches < least:
        raise ValueError(
            f"schedule={name!r} needs at least 2K - 1 = {least} micro-batches on {num_devices} devices, got "
            f"num_micro_batches={num_micro_batches}; use more micro-batches or schedule='zbv'."
        )
    return num_micro_batches


def placement(name: str, num_cells: int, num_devices: int) -> list[int]:
    """The device (0 to K-1) of each of the ``num_cells`` cells under schedule ``name`` on ``num_devices`` devices.

    One-cell schedules: cell i on device i (K = N). Interleaved ones: cell c on device c mod K (N a multiple of
    K). ``V_SCHEDULES``: cells d and 2K-1-d on device d (N = 2K).
    """
    check_name(name)
    n, k = positive_int("num_cells", num_cells), positive_int("num_devices", num_devices)
    if is_written(name):
        orders = _orders_of(name)
        cells = {task.cell: d for d, order in enumerate(orders) for task in order}
        if len(orders) != k or sorted(cells) != list(range(n)):
            raise ValueError(
                f"The written schedule runs cells {sorted(cells)} on {len(orders)} devices; the model has {n} cells "
                f"(0-{n - 1}) on {k} devices: write a task list per device, or pass devices=[{len(orders)} devices]."
            )
        return [cells[c] for c in range(n)]
    if not shares_devices(name):
        if n != k:
            raise ValueError(f"schedule={name!r} puts one cell on each device: {n} cells need {n} devices, not {k}.")
        return list(range(n))
    if name in V_SCHEDULES:
        if n != 2 * k:
            raise ValueError(
                f"schedule={name!r} puts two cells on each device in a V: {k} devices take {2 * k} cells, not {n}; "
                f"use num_partitions={2 * k}, or {n // 2 if n % 2 == 0 else 'N/2'} devices."
            )
        return [c if c < k else 2 * k - 1 - c for c in range(n)]
    if n % k:
        raise ValueError(
            f"schedule={name!r} puts the cells round-robin on the devices, v per device: {n} cells do not divide "
            f"over {k} devices; use a multiple of {k} cells (num_partitions={k * max(2, n // k)}) or another "
            "number of devices."
        )
    return [c % k for c in range(n)]


def cell_orders(name: str, num_cells: int, num_micro_batches: int) -> list[list[Task]]:
    """Each cell's forward and backward tasks in the order the one-cell schedule ``name`` runs them."""
    check_name(name)
    if shares_devices(name):
        raise ValueError(f"schedule={name!r} orders the tasks of each device, not of each cell: use device_orders.")
    k_cells = positive_int("num_cells", num_cells)
    m = positive_int("num_micro_batches", num_micro_batches)
    orders = []
    for i in range(k_cells):
        forwards = [Task("F", i, j) for j in range(m)]
        if name in ("gpipe", "gpipe_batched_w"):
            backwards = [Task("B", i, j) for j in reversed(range(m))]
            orders.append(forwards + backwards + ([Task("W", i, ALL)] if name == "gpipe_batched_w" else []))
            continue
        # 1F1B, and zero bubble's B tasks: min(K-i, M) forwards, then one backward and one forward.
        warm = min(k_cells - i, m)
        deferred = i if name == "zero_bubble" else None  # W tasks held back behind their B
        order: list[Task] = forwards[:warm]
        for j in range(m):
            order.append(Task("B", i, j))
            if deferred is not None and j >= deferred:
                order.append(Task("W", i, j - deferred))
            if warm + j < m:
                order.append(forwards[warm + j])
        if deferred is not None:
            order += [Task("W", i, j) for j in range(max(m - deferred, 0), m)]
        orders.append(order)
    return orders


def device_orders(
    name: str, num_cells: int, num_micro_batches: int, num_devices: int | None = None
) -> list[list[Task]]:
    """Each device's tasks in the order schedule ``name`` runs them (``num_devices`` defaults to one per cell)."""
    k = num_cells if num_devices is None else num_devices
    where = placement(name, num_cells, k)
    if not shares_devices(name):
        return cell_orders(name, num_cells, num_micro_batches)
    m = positive_int("num_micro_batches", num_micro_batches)
    if is_written(name):
        return [list(order) for order in _orders_of(check_written(name, num_cells, m))]
    cells = [[c for c in range(num_cells) if where[c] == d] for d in range(k)]
    if name == "zbv":
        return _played(cells, num_cells, m, limit=2 * k)
    if name == "dualpipev":
        return [_dualpipev(k, m, d) for d in range(k)]
    if name == "looped_bfs":
        return [
            [Task("F", c, j) for c in mine for j in range(m)]
            + [Task("B", c, j) for c in reversed(mine) for j in reversed(range(m))]
            for mine in cells
        ]
    return [_interleaved(mine, m, k, d, split=name == "interleaved_zero_bubble") for d, mine in enumerate(cells)]


def _interleaved(cells: list[int], m: int, k: int, d: int, split: bool) -> list[Task]:
    """Device d's interleaved 1F1B order over its ``cells`` (in model order), K devices, M micro-batches."""
    # Groups of at least K micro-batches (all M where M < 2K), the larger first: with a last group shorter than
    # K, a device's forwards of its next cell outrun the backwards the others wait for (a deadlock).
    rounds = max(1, m // k)
    sizes = [m // rounds + (1 if r < m % rounds else 0) for r in range(rounds)]
    groups = [list(range(sum(sizes[:r]), sum(sizes[: r + 1]))) for r in range(rounds)]
    forwards = [Task("F", c, j) for group in groups for c in cells for j in group]
    backwards = [Task("B", c, j) for group in groups for c in reversed(cells) for j in group]
    warm = min(len(forwards), (len(cells) - 1) * len(groups[0]) + 2 * (k - 1 - d))
    order = forwards[:warm]
    deferred: list[Task] = []
    for n, b in enumerate(backwards):
        if warm + n < len(forwards):
            order.append(forwards[warm + n])
        order.append(b)
        if split:  # W d backwards after its B, as zero bubble's cell d
            deferred.append(Task("W", b.cell, b.micro_batch))
            if len(deferred) > d:
                order.append(deferred.pop(0))
    return order + deferred


def _dualpipev(k: int, m: int, d: int) -> list[Task]:
    """Device d's DualPipeV order (torch's ``ScheduleDualPipeV``): cell d down, cell 2K-1-d up; forwards fill the
    pipeline, the steady phase runs a forward and the other cell's whole backward (B, then its W) in turn (DualPipe
    overlaps such pairs; here they run one after the other), the drain splits its later backwards and their W
    tasks, oldest first, fill the waits. M >= 2K - 1."""
    check_micro_batches("dualpipev", m, k)
    down, up = d, 2 * k - 1 - d
    order: list[Task] = []
    forwards, backwards = {down: 0, up: 0}, {down: 0, up: 0}  # each cell's next micro-batch
    pending: list[Task] = []  # W tasks split off their B, run oldest first

    def forward(cell: int) -> None:
        order.append(Task("F", cell, forwards[cell]))
        forwards[cell] += 1

    def backward(cell: int, split: bool = False) -> None:
        j = backwards[cell]
        backwards[cell] += 1
        order.append(Task("B", cell, j))
        (pending if split else order).append(Task("W", cell, j))

    def weight() -> None:
        order.append(pending.pop(0))

    for _ in range(2 * (k - d - 1)):
        forward(down)
    for _ in range(d + 1):
        forward(down)
        forward(up)
    for _ in range(k - d - 1):
        backward(up, split=True)
        weight()
        forward(up)
    for _ in range(m - 2 * k + d + 1):  # the steady phase
        forward(down)
        backward(up)
        forward(up)
        backward(down)
    for _ in range(k - d - 1):
        backward(up)
        forward(up)
        backward(down)
    split = False
    for i in range(d + 1):  # the backwards drain: from halfway, split
        split = split or (i == (d + 1) // 2 and d % 2 == 1)
        backward(up, split)
        split = split or (i == (d + 1) // 2 and d % 2 == 0)
        backward(down, split)
    for _ in range(k - d - 1):
        weight()
        backward(down, split=True)
    while pending:
        weight()
    return order


def _played(cells: list[list[int]], num_cells: int, m: int, limit: int) -> list[list[Task]]:
    """Each device's order found by playing the step out with every task one time unit (B and W split).

    A device free at time t runs a ready B (earliest micro-batch, then latest cell), else a ready forward
    while it holds fewer than ``limit`` micro-batches of a cell (latest cell first, then earliest
    micro-batch), else its oldest pending W; else it waits for the next task to end. Where nothing can run
    anywhere under ``limit``, forwards are let past it.
    """
    k = len(cells)
    todo = [
        [Task("F", c, j) for c in mine for j in range(m)] + [Task("B", c, j) for c in mine for j in range(m)]
        for mine in cells
    ]
    ends: dict[Task, int] = {}
    free, held = [0] * k, [0] * k
    waiting_w: list[list[Task]] = [[] for _ in range(k)]
    orders: list[list[Task]] = [[] for _ in range(k)]
    over = False  # forwards let past the limit (never at a limit of 1F1B's memory: a safeguard)
    while any(todo) or any(waiting_w):
        t = min(free[d] for d in range(k) if todo[d] or waiting_w[d])
        ran = False
        for d in range(k):
            if free[d] == t and (todo[d] or waiting_w[d]):
                task = _next_played(todo[d], waiting_w[d], ends, t, num_cells, over or held[d] < limit)
                if task is None:
                    continue
                held[d] += {"F": 1, "B": 0, "W": -1}[task.kind]
                ends[task] = free[d] = t + 1
                orders[d].append(task)
                ran = True
        if not ran:
            later = [e for e in ends.values() if e > t]
            if not later and over:
                raise RuntimeError(f"the played schedule cannot go on from {[list(map(str, o)) for o in todo]}")
            over = over or not later  # nothing runs and nothing will end: let forwards past the limit
            for d in range(k):
                if free[d] == t:
                    free[d] = min(later) if later else t
    return orders


def _next_played(todo: list[Task], waiting_w: list[Task], ends: dict[Task, int], t: int, num_cells: int, room: bool):
    """The task a device free at time t runs in ``_played`` (taken off ``todo`` or ``waiting_w``), or None."""

    def ready(task: Task) -> bool:
        return all(dep in ends and ends[dep] <= t for dep in depends_on(task, num_cells))

    b = [x for x in todo if x.kind == "B" and ready(x)]
    f = [x for x in todo if x.kind == "F" and ready(x)] if room else []
    if b:
        task = min(b, key=lambda x: (x.micro_batch, -x.cell))
        waiting_w.append(Task("W", task.cell, task.micro_batch))
    elif f:
        task = min(f, key=lambda x: (-x.cell, x.micro_batch))
    elif waiting_w:
        return waiting_w.pop(0)
    else:
        return None
    todo.remove(task)
    return task


def steps(
    name: str, num_cells: int, num_micro_batches: int, backward: bool = True, num_devices: int | None = None
) -> list[Task]:
    """Every task of a step in an order that keeps each device's order and puts each task after its inputs.

    GPipe's is its clock-cycle order (``flatten(gpipe(...))``); forward-only steps run GPipe's
    forward whatever ``name``. Other schedules are merged from ``device_orders``, one task per device
    in turn whenever its inputs exist.
    """
    return list(_steps(check_name(name), num_cells, num_micro_batches, backward, num_devices))


@functools.lru_cache(maxsize=1024)
def _steps(name: str, num_cells: int, m: int, backward: bool, num_devices: int | None) -> tuple[Task, ...]:
    """``steps``, kept: the planner asks for one schedule's order once per remat mode, time and memory each (a
    played ZB-V of 16 cells and 32 micro-batches takes a tenth of a second)."""
    if name == "gpipe" or not backward:
        return tuple(flatten(gpipe(num_cells, m, backward=backward)))
    return tuple(merge(device_orders(name, num_cells, m, num_devices)))


def merge(orders: Sequence[Sequence[Task]]) -> list[Task]:
    """One order of all tasks that keeps each device's ``orders[d]`` and the data dependencies.

    F(i, j) needs F(i-1, j); B(i, j) needs F(i, j) and B(i+1, j); W(i, j) needs B(i, j). A
    ValueError names the tasks that wait on each other if the devices' orders cannot all be kept
    (a deadlock).
    """
    lanes = len(orders)
    num_cells = 1 + max((task.cell for order in orders for task in order), default=-1)
    done: set[Task] = set()
    position, merged = [0] * lanes, []
    while any(position[d] < len(orders[d]) for d in range(lanes)):
        moved = False
        for d in range(lanes):
            if position[d] < len(orders[d]) and _ready(orders[d][position[d]], done, num_cells):
                task = orders[d][position[d]]
                done.add(task)
                merged.append(task)
                position[d] += 1
                moved = True
        if not moved:
            waiting = [str(orders[d][position[d]]) for d in range(lanes) if position[d] < len(orders[d])]
            raise ValueError(f"The devices' task orders deadlock: {', '.join(waiting)} each wait for another.")
    return merged


def _ready(task: Task, done: set[Task], num_cells: int) -> bool:
    return all(dep in done for dep in depends_on(task, num_cells))


def depends_on(task: Task, num_cells: int) -> list[Task]:
    """The tasks whose results ``task`` reads: F(i, j) F(i-1, j); B(i, j) F(i, j) and B(i+1, j); W(i, j) B(i, j).

    W(i, all) reads every B(i, j); it names B(i, 0), the last of them in its cell's order.
    """
    i, j = task.cell, task.micro_batch
    if task.kind == "F":
        return [Task("F", i - 1, j)] if i > 0 else []
    if task.kind == "W":
        return [Task("B", i, 0 if j == ALL else j)]
    return [Task("F", i, j)] + ([Task("B", i + 1, j)] if i < num_cells - 1 else [])


def in_flight(order: Sequence[Task], num_cells: int) -> list[int]:
    """Per cell, the most micro-batches whose forward has run and backward has not: activations held at once.

    A micro-batch is held until its cell's last backward task: W where the order has W tasks, else B.
    """
    return held_per_device(order, range(num_cells))  # as if each cell had a device of its own


def held_per_device(order: Sequence[Task], where: Sequence[int]) -> list[int]:
    """Per device, the most micro-batches of its cells held at once (each a cell's activations; see ``in_flight``).

    ``where`` is each cell's device (``placement``).
    """
    split = {task.cell for task in order if task.kind == "W"}
    held, peak = [0] * (max(where, default=-1) + 1), [0] * (max(where, default=-1) + 1)
    for task in order:
        d = where[task.cell]
        if task.kind == "F":
            held[d] += 1
        elif task.kind == "W" and task.micro_batch == ALL:
            held[d] = 0  # gpipe_batched_w: one cell per device
        elif task.kind == ("W" if task.cell in split else "B"):
            held[d] -= 1
        peak[d] = max(peak[d], held[d])
    return peak


def flatten(cycles: Sequence[Sequence[Task]]) -> list[Task]:
    """All tasks in clock-cycle order; every task comes after the tasks it depends on."""
    return [task for cycle in cycles for task in cycle]


def device_order(cycles: Sequence[Sequence[Task]], cell_devices: Sequence[str]) -> dict[str, list[Task]]:
    """For each device, its tasks in the order the device must run them (clock cycle, then cell)."""
    order: dict[str, list[Task]] = {}
    for cycle in cycles:
        for task in sorted(cycle, key=lambda t: t.cell):
            order.setdefault(cell_devices[task.cell], []).append(task)
    return order


def simulate(
    num_cells: int,
    num_micro_batches: int,
    f_cost: Sequence[float],
    b_cost: Sequence[float],
    name: str = "gpipe",
    w_cost: Sequence[float] | None = None,
    r_cost: Sequence[float] | None = None,
    recomputed: Collection[int] = (),
    num_devices: int | None = None,
    crossing: float = 0.0,
    inputs_first: bool = False,
) -> list[tuple[Task, float, float]]:
    """(task, start, end) of every task of schedule ``name``, cell i taking f_cost[i] per F and b_cost[i] per
    whole backward on its device (``placement``; one per cell unless ``num_devices`` says fewer).

    ``w_cost[i]`` is the part of b_cost[i] that computes weight gradients (default: half,
    the zero-bubble paper's T_B = T_W): a schedule that splits backwards runs it as W and
    the rest as B. With ``inputs_first`` (as tfpipe's inlined steps run), a whole backward
    whose input gradients go to another device hands them over w_cost[i] before its end.
    The B task of each micro-batch in ``recomputed`` first recomputes the cell's forward,
    r_cost[i] more (default: f_cost[i]), as tfpipe does once the incoming gradient is there.
    Tasks come in the order of ``steps``; a task starts when its device has finished the task
    before it and the tasks it ``depends_on`` have, ``crossing`` later where one of those ran
    on another device (a transfer's latency; default: none).
    """
    positive_int("num_cells", num_cells)
    m = positive_int("num_micro_batches", num_micro_batches)
    where = placement(name, num_cells, num_cells if num_devices is None else num_devices)
    f_cost, b_cost = _costs("f_cost", f_cost, num_cells), _costs("b_cost", b_cost, num_cells)
    w_cost = [b / 2 for b in b_cost] if w_cost is None else _costs("w_cost", w_cost, num_cells)
    r_cost = f_cost if r_cost is None else _costs("r_cost", r_cost, num_cells)
    if not crossing >= 0:
        raise ValueError(f"crossing must be a duration >= 0 (a transfer's latency between devices), got {crossing!r}.")
    if any(w > b for w, b in zip(w_cost, b_cost)):
        raise ValueError(f"w_cost {list(w_cost)} is part of b_cost {list(b_cost)}: each must be at most b_cost's.")
    bad = [j for j in recomputed if not (isinstance(j, int) and 0 <= j < m)]
    if bad:
        raise ValueError(f"recomputed holds {bad}: it lists micro-batch indices from 0 to {m - 1}.")
    split = splits_backward(name)
    cost = {"F": f_cost, "B": [b - w for b, w in zip(b_cost, w_cost)] if split else b_cost, "W": w_cost}
    done: dict[Task, float] = {}  # when each task's results are there for the tasks that depend on it
    free = [0.0] * (max(where) + 1)
    out = []
    for task in steps(name, num_cells, m, num_devices=num_devices):
        device = where[task.cell]
        ready = max(
            (done[dep] + (crossing if where[dep.cell] != device else 0.0) for dep in depends_on(task, num_cells)),
            default=0.0,
        )
        start = max(free[device], ready)
        duration = cost[task.kind][task.cell] * (m if task.micro_batch == ALL else 1)
        if task.kind == "B" and task.micro_batch in recomputed:
            duration += r_cost[task.cell]
        free[device] = start + duration
        early = inputs_first and not split and task.kind == "B" and task.cell and where[task.cell - 1] != device
        done[task] = free[device] - (w_cost[task.cell] if early else 0.0)
        out.append((task, start, free[device]))
    return out


def idle_fraction(simulated: Sequence[tuple[Task, float, float]], num_devices: int) -> float:
    """Share of each device's time idle in a ``simulate`` result: 1 - busy / (K devices x the step's span)."""
    span = max((end for _, _, end in simulated), default=0.0)
    busy = sum(end - start for _, start, end in simulated)
    return 1.0 - busy / (num_devices * span) if span > 0 else 0.0


def predicted_bubble(name: str, num_cells: int, num_micro_batches: int, num_devices: int | None = None) -> float:
    """The idle share of schedule ``name`` with equal cells, a backward twice the forward and W half of it.

    (K-1)/(M+K-1) for GPipe and 1F1B; for zero bubble (K-1)/(3M+K-1) when M >= K.
    """
    n = positive_int("num_cells", num_cells)
    k = n if num_devices is None else positive_int("num_devices", num_devices)
    ones = [1.0] * n
    return idle_fraction(simulate(n, num_micro_batches, ones, [2.0] * n, name, num_devices=k), k)


def _costs(name: str, costs: Sequence[float], num_cells: int) -> list[float]:
    """``costs`` as floats if it holds one duration >= 0 per cell, else a ValueError naming it."""
    try:
        values = [float(c) for c in costs]
    except (TypeError, ValueError):
        values = []
    if len(values) != num_cells or any(not v >= 0 for v in values):
        raise ValueError(f"{name} must be a list of {num_cells} durations >= 0, one per cell, got {costs!r}.")
    return values


def bubble_fraction(num_cells: int, num_micro_batches: int) -> float:
    """Share of each device's time spent idle in a GPipe step: (K-1) / (M+K-1)."""
    positive_int("num_cells", num_cells)
    positive_int("num_micro_batches", num_micro_batches)
    return (num_cells - 1) / (num_micro_batches + num_cells - 1)


def ideal_speedup(num_cells: int, num_micro_batches: int) -> float:
    """Speed-up over one device if cells are perfectly balanced: K*M / (M+K-1)."""
    return num_cells * (1.0 - bubble_fraction(num_cells, num_micro_batches))


def allowed_speedup(
    name: str, num_cells: int, num_micro_batches: int, recomputed: Collection[int] = (), num_devices: int | None = None
) -> float:
    """The speed-up over one device (M=1, no recomputation) that schedule ``name`` allows with equal cells.

    ``simulate`` with a backward twice the forward and a recomputation as long as the forward,
    for the micro-batches in ``recomputed``: the ceiling of a pipeline whose every task and
    transfer costs nothing more. Without recomputation it is ``ideal_speedup`` for GPipe and
    1F1B; with ``remat="except_last"`` (all but the last micro-batch), GPipe at K=2, M=8
    allows 48/35 = 1.37x, 77% of the ideal 1.78x.
    """
    n = positive_int("num_cells", num_cells)
    ones = [1.0] * n
    timed = simulate(n, num_micro_batches, ones, [2.0] * n, name, recomputed=recomputed, num_devices=num_devices)
    return 3.0 * n * num_micro_batches / max(end for _, _, end in timed)


def task_scope_name(task: Task) -> str:
    """The name scope of a task's ops in the graph: "F_1_3" for the forward of cell 1 on micro-batch 3."""
    return f"{task.kind}_{task.cell}_{micro_batch_name(task.micro_batch)}"
