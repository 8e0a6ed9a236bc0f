"""Weights made where their cell lives: a model built under ``deferred_weights()`` holds shapes until it is cut.

A Functional model or a keras_hub task makes every weight where it is built, so a model too large for one
device could not be handed to ``PipelineModel`` at all. Built under ``deferred_weights()``, each weight keeps
its shape, dtype and initializer but no value (no memory anywhere), and ``Model.load_weights`` calls (a keras_hub
``from_preset``'s own) are recorded. ``PipelineModel`` then makes each cell's weights from their initializers
on the cell's device (``place``), and runs the recorded loads once every weight has its device (``finish``):
Keras reads a weights file one variable at a time, so no device, the client's included, holds more than its
cells' weights and one variable in transit. It is what torch's meta device and Megatron's per-rank build do.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator

import keras

from tfpipe import _compat


@dataclasses.dataclass
class Record:
    """What one ``deferred_weights()`` block deferred: its variables, and the weight loads it recorded."""

    variables: list[keras.Variable] = dataclasses.field(default_factory=list)
    loads: list[tuple[keras.Model, tuple, dict]] = dataclasses.field(default_factory=list)


_WAITING: dict[int, tuple[keras.Variable, Record]] = {}  # id(variable) -> (variable, its block), until placed


@contextlib.contextmanager
def deferred_weights() -> Iterator[None]:
    """Build models whose weights wait, without memory, until ``PipelineModel`` makes each on its cell's device.

    ::

        with tfpipe.deferred_weights():
            task = keras_hub.models.CausalLM.from_preset("llama3_8b_en")   # shapes only; the load is recorded
        model = tfpipe.PipelineModel(task, num_partitions=4, devices=[...])  # made on each device, then loaded

    Inside the block, a weight made from an initializer has no value, and ``Model.load_weights`` is recorded and run
    after the weights are placed. A model built here is for ``PipelineModel``: used on its own before that, its
    weights read as fresh initial values and cannot be assigned.
    """
    record = Record()

    def on_variable(variable: keras.Variable) -> None:
        record.variables.append(variable)
        _WAITING[id(variable)] = (variable, record)

    def on_load(model: keras.Model, args: tuple, kwargs: dict) -> None:
        record.loads.append((model, args, kwargs))

    with _compat.deferring_variables(on_variable, on_load):
        yield


def waiting(variable: keras.Variable) -> bool:
    """Whether ``variable`` was deferred by ``deferred_weights()`` and has no device yet."""
    return id(variable) in _WAITING and _compat.is_deferred(variable)


def place(variable: keras.Variable, device: str | None) -> Record:
    """Make a waiting variable's value on ``device`` (None: where the caller's scope puts it); return its block."""
    _, record = _WAITING.pop(id(variable))
    _compat.make_deferred(variable, device)
    return record


def finish(records: Iterable[Record], device: str | None = None) -> None:
    """Make the blocks' variables that no cell holds on ``device`` (a task's metrics: small), then run their loads.

    A load waits for every variable of its block: the weights file names them all.
    """
    for record in {id(r): r for r in records}.values():
        for variable in record.variables:
            if waiting(variable):
                place(variable, device)
        loads, record.loads = record.loads, []
        for model, args, kwargs in loads:
            _compat.load_weights(model, *args, **kwargs)
