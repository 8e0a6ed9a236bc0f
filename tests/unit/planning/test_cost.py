"""Per-layer cost estimates: FLOPs of known layers, fallbacks that are reported, time and memory, errors."""

import keras
import numpy as np
import pytest

from tests.util import run_fresh
from tfpipe import cost
from tfpipe.planning import walk


def _flops(layers, sample):
    return cost.estimate(layers, sample, "flops").costs


@pytest.mark.parametrize("batch", [1, 5])
def test_dense_flops_per_sample(batch):
    x = np.zeros((batch, 6), "float32")
    no_bias, with_bias = _flops([keras.layers.Dense(7, use_bias=False), keras.layers.Dense(5)], x)
    assert no_bias == 2 * 6 * 7  # a Dense(n -> m) is 2nm FLOPs per sample
    assert with_bias == 2 * 7 * 5 + 5  # plus one add per output for the bias


def test_dense_on_a_sequence_counts_every_position():
    (flops,) = _flops([keras.layers.Dense(3, use_bias=False)], np.zeros((2, 10, 4), "float32"))
    assert flops == 10 * 2 * 4 * 3


def test_convolution_flops():
    x = np.zeros((2, 8, 8, 3), "float32")
    conv, depthwise = _flops([keras.layers.Conv2D(4, 3), keras.layers.DepthwiseConv2D(3)], x)
    assert conv == 2 * (6 * 6 * 4) * (3 * 3 * 3) + 6 * 6 * 4
    assert depthwise == 2 * (4 * 4 * 4) * (3 * 3) + 4 * 4 * 4
    (conv1d,) = _flops([keras.layers.Conv1D(5, 2, use_bias=False)], np.zeros((1, 9, 3), "float32"))
    assert conv1d == 2 * (8 * 5) * (2 * 3)


def test_embedding_is_free_and_elementwise_layers_count_their_elements():
    ids = np.zeros((3, 10), "int32")
    embedding, relu, norm = _flops(
        [keras.layers.Embedding(50, 8), keras.layers.Activation("relu"), keras.layers.LayerNormalization()], ids
    )
    assert embedding == 0.0  # a gather moves data, it does no arithmetic
    assert relu == 10 * 8
    assert 4 * 80 <= norm <= 12 * 80  # mean, variance, normalize, scale, shift: a few ops per element


@keras.saving.register_keras_serializable("tfpipe_tests")
class SelfAttention(keras.layers.Layer):
    """A composite layer: multi-head self-attention with its projections."""

    def __init__(self, heads, key_dim, **kwargs):
        super().__init__(**kwargs)
        self.heads, self.key_dim = heads, key_dim
        self.attention = keras.layers.MultiHeadAttention(heads, key_dim)

    def call(self, x):
        return self.attention(x, x)

    def get_config(self):
        return {**super().get_config(), "heads": self.heads, "key_dim": self.key_dim}


def test_multi_head_attention_flops_are_its_matmuls_plus_a_little():
    t, d, h, k = 12, 16, 4, 8
    (flops,) = _flops([SelfAttention(h, k)], np.zeros((2, t, d), "float32"))
    matmuls = 3 * (2 * t * d * h * k) + 2 * (2 * t * t * h * k) + 2 * t * h * k * d
    assert matmuls <= flops <= 1.15 * matmuls


@keras.saving.register_keras_serializable("tfpipe_tests")
class CumulativeSum(keras.layers.Layer):
    """A layer whose op (Cumsum) the FLOP tables do not know."""

    def call(self, x):
        return keras.ops.cumsum(x, axis=-1)


@keras.saving.register_keras_serializable("tfpipe_tests")
class EagerOnly(keras.layers.Layer):
    """A Dense-like layer that cannot be traced into a graph (it reads a tensor's value in Python)."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 3))

    def compute_output_spec(self, x):
        return keras.KerasTensor(x.shape[:-1] + (3,), dtype=x.dtype)

    def call(self, x):
        return x @ self.kernel * float(x.numpy().sum() * 0 + 1)


def test_unknown_ops_and_untraceable_layers_fall_back_and_are_reported():
    x = np.zeros((2, 5), "float32")
    with pytest.warns(cost.CostEstimateWarning, match=r"layer 0 \(cumulative_sum.*\['Cumsum'\].*one FLOP per output"):
        estimate = cost.estimate([CumulativeSum(name="cumulative_sum")], x)
    assert estimate.costs == [5.0] and "Cumsum" in estimate.notes[0]
    with pytest.warns(cost.CostEstimateWarning, match=r"layer 1 \(eager_only\): not traceable .* 2 x 15 parameters"):
        estimate = cost.estimate([keras.layers.Dense(5, use_bias=False), EagerOnly(name="eager_only")], x)
    assert estimate.costs == [50.0, 30.0] and list(estimate.notes) == [1]


def test_output_bytes_per_sample_and_params():
    estimate = cost.estimate(
        [keras.layers.Dense(6), keras.layers.Dense(2, dtype="float64")], np.zeros((4, 3), "float32"), "params"
    )
    assert estimate.costs == [3 * 6 + 6, 6 * 2 + 2]
    assert estimate.output_bytes == [6 * 4, 2 * 8]


def test_identical_layers_on_the_same_input_are_copied_and_traced_once(monkeypatch):
    copies = []
    real = walk.copy_layer
    monkeypatch.setattr(walk, "copy_layer", lambda layer, *args: copies.append(layer.name) or real(layer, *args))
    layers = [keras.layers.Dense(8, activation="tanh", name=f"d{i}") for i in range(4)] + [keras.layers.Dense(3)]
    layers.insert(1, keras.layers.Dense(8, activation="relu", name="other"))  # another configuration
    estimate = cost.estimate(layers, np.zeros((2, 8), "float32"))
    assert copies == ["d0", "other", layers[-1].name]  # d1..d3: d0's configuration on the same 8-wide input
    assert estimate.costs[2:5] == [estimate.costs[0]] * 3 and estimate.output_bytes[2:5] == [32.0] * 3
    assert estimate.costs == cost.estimate(layers[:1], np.zeros((2, 8), "float32")).costs + estimate.costs[1:]


def test_nested_inputs_and_outputs_are_walked():
    @keras.saving.register_keras_serializable("tfpipe_tests")
    class Pair(keras.layers.Layer):
        def call(self, pair):
            a, b = pair
            return a + b, a * b

    @keras.saving.register_keras_serializable("tfpipe_tests")
    class Sum(keras.layers.Layer):
        def call(self, pair):
            return pair[0] + pair[1]

    sample = (np.ones((2, 4), "float32"), np.ones((2, 4), "float32"))
    estimate = cost.estimate([Pair(), Sum()], sample)
    assert estimate.costs == [8.0, 4.0] and estimate.output_bytes == [32.0, 16.0]


def test_estimates_leave_the_layers_unbuilt_and_the_random_stream_as_it_was():
    layers = [keras.layers.Dense(4), keras.layers.Dropout(0.5), keras.layers.Dense(2)]
    keras.utils.set_random_seed(7)
    cost.estimate(layers, np.ones((3, 5), "float32"), "time", repeats=1)
    after = keras.layers.Dense(3)  # its initializer seed comes from Python's random stream
    keras.utils.set_random_seed(7)
    reference = keras.layers.Dense(3)
    assert not layers[0].built and not layers[2].built
    after.build((None, 2))
    reference.build((None, 2))
    np.testing.assert_array_equal(after.kernel.numpy(), reference.kernel.numpy())


def test_time_is_positive_and_grows_with_the_work():
    # about 1.1 GFLOPs against 17 MFLOPs: far apart even on a loaded machine
    x = np.ones((128, 256), "float32")
    large, small = cost.estimate([keras.layers.Dense(16384), keras.layers.Dense(4)], x, "time", repeats=3).costs
    assert 0 < small < large


def test_callable_cost_is_applied_to_the_users_layers():
    layers = [keras.layers.Dense(3, name="a"), keras.layers.Dense(9, name="b")]
    estimate = cost.estimate(layers, np.ones((2, 2), "float32"), cost=lambda layer: layer.units * 10.0)
    assert estimate.costs == [30.0, 90.0] and estimate.kind == "custom"


def test_memory_needs_an_allocator_that_reports():
    with pytest.raises(ValueError, match="TF_CPU_ALLOCATOR_USE_BFC=true"):
        cost.estimate([keras.layers.Dense(4)], np.ones((2, 3), "float32"), "memory")


def test_memory_with_the_bfc_allocator_counts_weights_and_activations():
    proc = run_fresh(
        """
        import keras, numpy as np
        from tfpipe import cost
        x = np.ones((32, 64), "float32")
        est = cost.estimate([keras.layers.Dense(512), keras.layers.Dense(8)], x, "memory")
        print("COSTS", *est.costs)
    """,
        env={"TF_CPU_ALLOCATOR_USE_BFC": "true"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    big, small = (float(v) for v in proc.stdout.split("COSTS")[1].split())
    weights_big, weights_small = (64 * 512 + 512) * 4, (512 * 8 + 8) * 4
    # at least the weights and their gradients, plus the input gradient and activations
    assert big >= 2 * weights_big and small >= 2 * weights_small + 32 * 512 * 4
    assert big > small


def test_errors_name_the_value_and_the_fix():
    x = np.ones((4, 5), "float32")
    with pytest.raises(ValueError, match=r"Unknown cost='bytes'; use one of 'flops'"):
        cost.estimate([keras.layers.Dense(2)], x, "bytes")
    with pytest.raises(ValueError, match=r"Layer 0 \(conv\) cannot take the input .*float32\[4, 5\].* from the sample"):
        cost.estimate([keras.layers.Conv2D(2, 3, name="conv")], x)
    with pytest.raises(ValueError, match=r"Layer 1 \(conv\) cannot take the input .* from layer 0 \(dense\)"):
        cost.estimate([keras.layers.Dense(3, name="dense"), keras.layers.Conv2D(2, 3, name="conv")], x)
    with pytest.raises(ValueError, match="sample must be a batch of data"):
        cost.estimate([keras.layers.Dense(2)], 3.0)
    with pytest.raises(ValueError, match=r"The cost of layer 0 \(d\) is -1.0; costs must be finite and >= 0"):
        cost.estimate([keras.layers.Dense(2, name="d")], x, cost=lambda layer: -1.0)
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        cost.estimate([keras.layers.Dense(2)], x, "time", repeats=0)

    class NoCopy(keras.layers.Dense):
        def get_config(self):
            raise NotImplementedError("no config")

    with pytest.raises(ValueError, match=r"Cannot copy layer 'nc' \(NoCopy\).*get_config\(\).*balance=\[...\]"):
        cost.estimate([NoCopy(2, name="nc")], x)


def test_loops_and_function_calls_are_counted_through():
    import tensorflow as tf

    steps, features, units = 5, 3, 4
    (lstm,) = _flops([keras.layers.LSTM(units)], np.zeros((2, steps, features), "float32"))
    matmuls = steps * 2 * (features + units) * 4 * units  # input and recurrent kernels, four gates, every step
    assert matmuls <= lstm <= 1.6 * matmuls

    @keras.saving.register_keras_serializable("tfpipe_tests")
    class Called(keras.layers.Layer):
        """A layer whose work sits inside a nested tf.function (a call op in the graph)."""

        def build(self, input_shape):
            self.kernel = self.add_weight(shape=(input_shape[-1], 6))

        def call(self, x):
            return tf.function(lambda t: tf.matmul(t, self.kernel.value))(x)

    (called,) = _flops([Called()], np.zeros((3, 5), "float32"))
    assert called == 2 * 5 * 6


def test_a_product_over_an_unknown_dimension_is_an_unknown_op_not_an_error():
    # A weight's gradient in a graph general in its rows: x^T g has a known output (the kernel's shape) and an inner
    # dimension of None (the rows); it is counted as unknown, as an op of unknown output is
    import tensorflow as tf

    from tfpipe.planning import flops

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        g = tf.compat.v1.placeholder(tf.float32, [None, 4])
        tf.matmul(x, g, transpose_a=True)
        tf.linalg.matmul(tf.reshape(x, [1, -1, 3]), tf.reshape(g, [1, -1, 4]), adjoint_a=True)
        tf.matmul(tf.ones([2, 3]), tf.ones([3, 4]))  # known: 2 x 4 outputs, 3 inner
    total, unknown = flops.graph_flops(graph)
    assert total >= 2 * 2 * 4 * 3 and unknown >= {"MatMul", "BatchMatMulV2"}, unknown


@pytest.mark.parametrize("layer,mode", [(keras.layers.LSTM, "lstm"), (keras.layers.GRU, "gru")])
def test_a_cudnn_recurrence_counts_like_the_layer_it_runs(layer, mode):
    # On a GPU, Keras runs an LSTM or GRU as one CudnnRNNV3 op; a balance by FLOPs must see the same work there.
    import tensorflow as tf

    from tfpipe.planning import flops

    steps, batch, features, units = 10, 2, 32, 64  # wide enough that the products dominate, as they do in use
    (on_cpu,) = _flops([layer(units)], np.zeros((batch, steps, features), "float32"))
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [batch, steps, features])
        h = tf.compat.v1.placeholder(tf.float32, [1, batch, units])
        params = tf.compat.v1.placeholder(tf.float32, [None])
        lengths = tf.constant([steps] * batch)
        tf.raw_ops.CudnnRNNV3(
            input=x, input_h=h, input_c=h, params=params, sequence_lengths=lengths, rnn_mode=mode, time_major=False
        )
    total, unknown = flops.graph_flops(graph)
    assert not unknown
    assert 0.8 * on_cpu <= total / batch <= 1.25 * on_cpu
