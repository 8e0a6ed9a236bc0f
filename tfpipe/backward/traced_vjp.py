"""The traced-VJP cache: a cell's recompute-and-VJP functions, traced once per outer graph and input signature.

Inside a graph, a recomputed backward (``tfpipe.backward.remat.Checkpoint``) can be one traced
function: recompute, VJP and the sum into the running weight gradients, traced once per cell
and called once per micro-batch, so that the step graph does not grow with M by a tape
gradient and a sum per weight for every task. ``TracedVJPs`` keeps those functions, the
sums of running gradients, and the parts of split VJPs, per graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ContextManager, Protocol, TypeVar

import tensorflow as tf

from tfpipe.graph import calls
from tfpipe.graph.names import GRADIENT_SUM, SPLIT_FORWARD, TRACED_VJP


@dataclasses.dataclass
class Traced:
    """One traced function and the source positions whose gradients it returns as slices."""

    function: Any  # ConcreteFunction: (sources, extras, output grads, running sums) -> gradients, flattened
    sparse: frozenset[int]  # source positions whose gradient is returned as (values, indices, dense_shape)


class _Sparse(Protocol):
    """What ``TracedVJPs.lookup`` keeps: something traced that says which source positions get slices."""

    sparse: frozenset[int]


_Built = TypeVar("_Built", bound=_Sparse)  # what ``lookup`` caches: a ``Traced``, or a ``SplitVJP``


class TracedVJPs:
    """The traced backward functions of one cell, per outer graph and input signature."""

    def __init__(self, scope: Callable[[], ContextManager], options: Callable[[], dict[str, Any]]):
        """``scope()`` is entered around the traced body (the cell's device); ``options()`` gives the cell's
        ``tf.function`` options (``Cell.function_options``)."""
        self._scope = scope
        self.options = options
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # outer graph -> {key: Traced}
        self._sparse: dict[Any, frozenset[int]] = {}  # key -> positions found sparse when first traced
        self.num_traces = 0

    def _here(self) -> dict[Any, Any]:
        """What was traced (and the shared empty tensors) for the current graph."""
        return self._graphs.setdefault(tf.compat.v1.get_default_graph(), {})

    def sparse(self, key: Any) -> frozenset[int]:
        """The source positions known to get sparse gradients under ``key``."""
        return self._sparse.get(key, frozenset())

    def lookup(self, key: Any, build: Callable[[], _Built]) -> _Built:
        """The function for ``key`` in the current graph, traced by ``build`` the first time."""
        traces = self._here()
        if key not in traces:
            traces[key] = build()
            self._sparse[key] = traces[key].sparse
        return traces[key]

    def placeholder(self, like: tf.Tensor) -> tf.Tensor:
        """An empty tensor of ``like``'s dtype and rank, one per graph: every call site passes the same node.

        (Grappler's function optimizer copies a function for each distinct constant input.)
        """
        traces = self._here()
        key = ("empty", like.dtype, like.shape.rank)
        if key not in traces:
            with tf.control_dependencies(None):
                traces[key] = tf.zeros([0] * like.shape.rank, like.dtype)
        return traces[key]

    def sum(self, a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """``[x + y for x, y in zip(a, b)]`` as one call of a function traced once per signature."""
        args = [tf.convert_to_tensor(t) for t in list(a) + list(b)]
        key = ("sum", tuple((tuple(t.shape), t.dtype) for t in args))
        traces = self._here()
        if key not in traces:
            n = len(a)

            def body(*flat: tf.Tensor) -> list[tf.Tensor]:
                return [x + y for x, y in zip(flat[:n], flat[n:])]

            body.__name__ = GRADIENT_SUM  # how tfpipe.analysis.graph_tasks recognizes the call in a step's graph
            specs = [tf.TensorSpec(t.shape, t.dtype) for t in args]
            function = tf.function(body, autograph=False, **self.options())
            traces[key] = Traced(function.get_concrete_function(*specs), frozenset())
        return calls.call(traces[key].function, args)

    def wrap(self, function: Any, specs: Sequence[tf.TensorSpec], part: str) -> Any:
        """A part of a split VJP (``backward.split_vjp``) as the function a task calls, inlined or not as the cell is.

        Named so that tfpipe.analysis.graph_tasks tells a forward part from a gradient part.
        """

        def body(*flat: tf.Tensor) -> Any:
            return function(*flat)

        body.__name__ = SPLIT_FORWARD if part == "forward" else f"{TRACED_VJP}_{part}"
        with self.tracing():
            return tf.function(body, autograph=False, **self.options()).get_concrete_function(*specs)

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """The context of a traced body: the cell's scope."""
        with self._scope():
            yield
