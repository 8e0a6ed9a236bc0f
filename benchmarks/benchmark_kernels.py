"""Where a backward task's time goes on one CPU thread: plain Keras VJP against forward, per micro-batch size.

No tfpipe code runs here: a stack of Dense + tanh layers is timed as plain Keras in a
tf.function, forward alone and forward + vector-Jacobian product (GradientTape), on
one thread (intra- and inter-op parallelism 1, as in a LocalCluster worker). Then the
three matrix products of one Dense layer's backward are timed on their own, with
the operand layouts TensorFlow's MatMul gradient uses and one alternative. Last, one
layer's weight gradient over the whole batch against the same rows in micro-batches
(one product each, then summed as a pipeline's running sum does), and the whole
stack's forward and backward in micro-batches with its weight gradients taken per
micro-batch (as tfpipe does) or once over all of them (a design not built).

    python benchmarks/benchmark_kernels.py                      # width 768, 8 layers, rows 256, 32
    python benchmarks/benchmark_kernels.py --dim=1024 --rows=128,16
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("dim", 768, "Layer width.", lower_bound=8)
flags.DEFINE_integer("layers", 8, "Dense + tanh layers.", lower_bound=1)
flags.DEFINE_list("rows", ["256", "32"], "Rows per call: a whole batch, then a micro-batch of it.")
flags.DEFINE_integer("repeats", 30, "Timed calls per figure (median).", lower_bound=3)


def _median_ms(fn, repeats: int) -> float:
    import numpy as np

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        for t in fn():
            t.numpy()
        times.append(time.perf_counter() - began)
    return 1e3 * float(np.median(times))


def main(argv: list[str]) -> None:
    del argv
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    d = FLAGS.dim
    model = keras.Sequential(
        [keras.Input((d,))] + [keras.layers.Dense(d, activation="tanh") for _ in range(FLAGS.layers)]
    )
    print(f"{FLAGS.layers} x Dense({d}) + tanh, one thread; median of {FLAGS.repeats} calls")
    print("rows  forward ms  forward+VJP ms  VJP/forward  | per product ms: x@W  dy@W^T  (W@dy^T)^T  x^T@dy")
    for rows in (int(r) for r in FLAGS.rows):
        x, dy = tf.random.normal((rows, d)), tf.random.normal((rows, d))
        forward = tf.function(lambda: [model(x)])

        @tf.function
        def vjp():
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = model(x)
            return tape.gradient(y, [x] + model.trainable_variables, output_gradients=dy)

        f_ms, v_ms = _median_ms(forward, FLAGS.repeats), _median_ms(vjp, FLAGS.repeats)
        # Eight independent operand sets per call, so that no two products are the same op.
        xs = [tf.random.normal((rows, d)) for _ in range(8)]
        dys = [tf.random.normal((rows, d)) for _ in range(8)]
        ws = [tf.random.normal((d, d)) for _ in range(8)]
        products = {
            "x@W": lambda: [tf.matmul(a, w) for a, w in zip(xs, ws)],
            "dy@W^T": lambda: [tf.matmul(g, w, transpose_b=True) for g, w in zip(dys, ws)],
            "(W@dy^T)^T": lambda: [tf.transpose(tf.matmul(w, g, transpose_b=True)) for g, w in zip(dys, ws)],
            "x^T@dy": lambda: [tf.matmul(a, g, transpose_a=True) for a, g in zip(xs, dys)],
        }
        per = [_median_ms(tf.function(fn), FLAGS.repeats) / 8 for fn in products.values()]
        print(
            f"{rows:>4}  {f_ms:10.2f}  {v_ms:14.2f}  {v_ms / f_ms:11.2f}  | " + "  ".join(f"{p:.3f}" for p in per),
            flush=True,
        )
    whole, micro = int(FLAGS.rows[0]), int(FLAGS.rows[-1])
    if whole // micro >= 2:  # the first rows in micro-batches of the last
        _weight_gradient_in_micro_batches(tf, d, whole, micro)
        _stack_with_batched_weight_gradients(tf, model, whole, micro)


def _weight_gradient_in_micro_batches(tf, d: int, whole: int, micro: int) -> None:
    """One Dense(d)'s weight gradient x^T@dy over the whole batch against M micro-batches' products and sum."""
    m = whole // micro
    x, dy = tf.random.normal((whole, d)), tf.random.normal((whole, d))
    xs, dys = tf.split(x, m), tf.split(dy, m)

    def running_sum() -> list:
        total = tf.matmul(xs[0], dys[0], transpose_a=True)
        for a, g in zip(xs[1:], dys[1:]):
            total = total + tf.matmul(a, g, transpose_a=True)
        return [total]

    timed = {
        "one product": lambda: [tf.matmul(x, dy, transpose_a=True)],
        f"{m} products": lambda: [tf.matmul(a, g, transpose_a=True) for a, g in zip(xs, dys)],
        f"{m} products, summed": running_sum,
    }
    figures = "  ".join(f"{name} {_median_ms(tf.function(fn), FLAGS.repeats):.2f} ms" for name, fn in timed.items())
    print(f"weight gradient of one Dense({d}), {whole} rows against {m} micro-batches of {micro}: {figures}")


def _stack_with_batched_weight_gradients(tf, model, whole: int, micro: int) -> None:
    """The stack's forward and hand-written backward in M micro-batches: weight gradients per micro-batch or batched."""
    m = whole // micro
    d = model.layers[0].kernel.shape[0]
    params = [(layer.kernel, layer.bias) for layer in model.layers]
    xs, dys = tf.split(tf.random.normal((whole, d)), m), tf.split(tf.random.normal((whole, d)), m)

    def step(batched: bool) -> list:
        kernel_grads = [None] * len(params)
        saved = [[] for _ in params]  # (layer input, gradient at its pre-activation) per micro-batch
        for x, dy in zip(xs, dys):
            inputs, h = [], x
            for kernel, bias in params:
                inputs.append(h)
                h = tf.tanh(tf.matmul(h, kernel) + bias)
            g, out = dy, h
            for j in reversed(range(len(params))):
                dz = g * (1.0 - out * out)
                if batched:
                    saved[j].append((inputs[j], dz))
                else:
                    dw = tf.matmul(inputs[j], dz, transpose_a=True)
                    kernel_grads[j] = dw if kernel_grads[j] is None else kernel_grads[j] + dw
                g, out = tf.transpose(tf.matmul(params[j][0], dz, transpose_b=True)), inputs[j]
        if batched:
            kernel_grads = [
                tf.matmul(tf.concat([a for a, _ in pairs], 0), tf.concat([z for _, z in pairs], 0), transpose_a=True)
                for pairs in saved
            ]
        return kernel_grads

    for a, b in zip(step(False), step(True)):  # the same gradients, in another order of sums
        if float(tf.reduce_max(tf.abs(a - b))) > 1e-3 * (1.0 + float(tf.reduce_max(tf.abs(a)))):
            raise RuntimeError("batched weight gradients differ from the per-micro-batch ones")
    each = _median_ms(tf.function(lambda: step(False)), FLAGS.repeats)
    once = _median_ms(tf.function(lambda: step(True)), FLAGS.repeats)
    print(f"{len(params)} layers in {m} micro-batches of {micro}, forward + backward: weight gradients per "
          f"micro-batch {each:.2f} ms, once over all micro-batches {once:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    app.run(main)
