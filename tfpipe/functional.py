"""A Keras Functional model as a layer sequence: today the models whose graph is a chain of layers."""

from __future__ import annotations

import keras

from tfpipe import _compat

WHY = (
    "tfpipe pipelines a Functional model whose layers form one chain (each layer takes the previous one's single "
    "output); skip connections, several inputs or outputs and keras.ops calls in the graph are not supported yet"
)


def is_functional(model: object) -> bool:
    """Whether ``model`` is a Keras model defined by a graph of symbolic calls (not a Sequential)."""
    return isinstance(model, keras.Model) and not isinstance(model, keras.Sequential) and hasattr(model, "operations")


def chain_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers of a Functional model in call order, if they form a chain; else a ValueError naming the node."""
    name = model.name
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise ValueError(
            f"Functional model {name!r} has {len(model.inputs)} inputs and {len(model.outputs)} "
            f"outputs; {WHY}. Give a model with one input and one output."
        )
    layers: list[keras.layers.Layer] = []
    tensor = model.outputs[0]
    while True:
        operation, node = _compat.producer(tensor)
        if isinstance(operation, keras.layers.InputLayer):
            break
        where = f"{type(operation).__name__} {operation.name!r} of Functional model {name!r}"
        if not isinstance(operation, keras.layers.Layer):
            raise ValueError(
                f"The operation {where} is a keras.ops call, not a layer; {WHY}. "
                "Wrap it in a keras.layers.Layer (or Lambda)."
            )
        inputs, kwargs = _compat.call_arguments(operation, node)
        if len(inputs) != 1:
            raise ValueError(
                f"Layer {where} takes {len(inputs)} tensors ({', '.join(t.name for t in inputs)}), "
                f"so the graph has a skip connection or a merge; {WHY}."
            )
        if kwargs:
            raise ValueError(
                f"Layer {where} is called with keyword arguments {sorted(kwargs)}, which a cell does "
                f"not pass on; {WHY}."
            )
        if _compat.num_calls(operation) != 1:
            raise ValueError(
                f"Layer {where} is called {_compat.num_calls(operation)} times (a shared layer); {WHY}. "
                "Use a separate layer for each call."
            )
        layers.append(operation)
        tensor = inputs[0]
    if tensor is not model.inputs[0]:
        raise ValueError(f"The chain of Functional model {name!r} does not start at its input; {WHY}.")
    return layers[::-1]
