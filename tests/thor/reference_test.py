"""Self-tests of the NumPy THOR reference, in NumPy only."""

import math

import numpy as np
import pytest

from tests.thor import reference

CE = "sparse_categorical_crossentropy_from_logits"


@pytest.fixture(autouse=True)
def _seeded():
    """Replaces the conftest's: no Keras session here, explicit generators."""
    yield


def _dense(units, activation="linear", use_bias=True):
    return {
        "type": "dense",
        "units": units,
        "activation": activation,
        "use_bias": use_bias,
    }


def _conv(filters, kernel_size, strides, padding, dilation, activation):
    return {
        "type": "conv2d",
        "filters": filters,
        "kernel_size": kernel_size,
        "strides": strides,
        "padding": padding,
        "dilation_rate": dilation,
        "activation": activation,
        "use_bias": True,
    }


def _kernel_and_bias(rng, kernel_shape):
    return {
        "kernel": rng.normal(scale=0.5, size=kernel_shape),
        "bias": rng.normal(scale=0.1, size=kernel_shape[-1]),
    }


def _labels(rng, n, classes):
    return rng.integers(0, classes, size=n)


def mlp_case(rng):
    """Dense relu -> dense linear, cross-entropy."""
    model = [_dense(5, "relu"), _dense(3)]
    weights = [_kernel_and_bias(rng, (4, 5)), _kernel_and_bias(rng, (5, 3))]
    return model, weights, rng.normal(size=(6, 4)), _labels(rng, 6, 3), CE


def cnn_case(rng):
    """Same/stride-1 relu conv -> valid/stride-2 conv -> GAP2D -> dense."""
    model = [
        _conv(3, (3, 3), (1, 1), "same", (1, 1), "relu"),
        _conv(4, (3, 3), (2, 2), "valid", (1, 1), "linear"),
        {"type": "global_average_pooling2d"},
        _dense(3),
    ]
    weights = [
        _kernel_and_bias(rng, (3, 3, 2, 3)),
        _kernel_and_bias(rng, (3, 3, 3, 4)),
        {},
        _kernel_and_bias(rng, (4, 3)),
    ]
    return model, weights, rng.normal(size=(2, 6, 6, 2)), _labels(rng, 2, 3), CE


def dilated_conv_case(rng):
    """Dilation 2, same padding, strides (2, 1), tanh -> flatten -> dense."""
    model = [
        _conv(2, (3, 3), (2, 1), "same", (2, 2), "tanh"),
        {"type": "flatten"},
        _dense(3),
    ]
    weights = [
        _kernel_and_bias(rng, (3, 3, 2, 2)),
        {},
        _kernel_and_bias(rng, (4 * 5 * 2, 3)),
    ]
    return model, weights, rng.normal(size=(2, 7, 5, 2)), _labels(rng, 2, 3), CE


def embedding_case(rng):
    """Embedding -> LayerNorm -> per-position dense tanh -> GAP1D -> dense."""
    model = [
        {"type": "embedding", "input_dim": 6, "output_dim": 4},
        {"type": "layer_norm", "epsilon": 1e-3},
        _dense(5, "tanh"),
        {"type": "global_average_pooling1d"},
        _dense(3),
    ]
    weights = [
        {"embeddings": rng.normal(size=(6, 4))},
        {"gamma": 1.0 + 0.3 * rng.normal(size=4), "beta": rng.normal(size=4)},
        _kernel_and_bias(rng, (4, 5)),
        {},
        _kernel_and_bias(rng, (5, 3)),
    ]
    ids = rng.integers(0, 6, size=(3, 4))
    return model, weights, ids, _labels(rng, 3, 3), CE


def mse_case(rng):
    """Dense tanh -> dense linear, MSE."""
    model = [_dense(4, "tanh"), _dense(2)]
    weights = [_kernel_and_bias(rng, (3, 4)), _kernel_and_bias(rng, (4, 2))]
    return (
        model,
        weights,
        rng.normal(size=(5, 3)),
        rng.normal(size=(5, 2)),
        "mse",
    )


CASES = {
    "mlp": mlp_case,
    "cnn": cnn_case,
    "dilated_conv": dilated_conv_case,
    "embedding": embedding_case,
    "mse": mse_case,
}


def _loss(model, weights, x, y, loss, sample_weight=None):
    return reference.forward_backward(
        model, weights, x, y, loss, sample_weight
    )[0]


def numeric_gradients(model, weights, x, y, loss, sample_weight, eps=1e-6):
    """Central differences of the loss w.r.t. every weight element."""
    grads = []
    for index, layer in enumerate(weights):
        grads.append({})
        for name, value in layer.items():
            grad = np.zeros_like(value)
            for position in np.ndindex(value.shape):
                moved = [dict(w) for w in weights]
                for sign in (1.0, -1.0):
                    shifted = value.copy()
                    shifted[position] += sign * eps
                    moved[index][name] = shifted
                    term = _loss(model, moved, x, y, loss, sample_weight)
                    grad[position] += sign * term / (2 * eps)
            grads[index][name] = grad
    return grads


def _rows(array):
    return array.reshape(-1, array.shape[-1])


class TestGradients:
    @pytest.mark.parametrize("case", sorted(CASES))
    @pytest.mark.parametrize("weighted", [False, True])
    def test_weight_gradients_match_finite_differences(self, case, weighted):
        rng = np.random.default_rng(1)
        model, weights, x, y, loss = CASES[case](rng)
        sample_weight = rng.uniform(0.2, 2.0, len(x)) if weighted else None
        _, grads, _ = reference.forward_backward(
            model, weights, x, y, loss, sample_weight
        )
        expected = numeric_gradients(model, weights, x, y, loss, sample_weight)
        for layer, layer_expected in zip(grads, expected):
            assert layer.keys() == layer_expected.keys()
            for name in layer:
                np.testing.assert_allclose(
                    layer[name], layer_expected[name], rtol=1e-6, atol=1e-8
                )

    @pytest.mark.parametrize("case", sorted(CASES))
    def test_output_grads_give_the_bias_and_kernel_gradients(self, case):
        """dL/db = sum of dz's rows; dL/dW = X^T dz (M^T dz for a conv)."""
        model, weights, x, y, loss = CASES[case](np.random.default_rng(2))
        _, grads, captures = reference.forward_backward(
            model, weights, x, y, loss
        )
        for index, capture in captures.items():
            spec, dz = model[index], _rows(capture["output_grad"])
            inputs = capture["inputs"]
            if spec["type"] == "conv2d":
                patches = reference.im2col(
                    inputs,
                    spec["kernel_size"],
                    spec["strides"],
                    spec["padding"],
                    spec["dilation_rate"],
                )[0]
                kernel = grads[index]["kernel"]
                np.testing.assert_allclose(
                    _rows(patches.T @ dz), _rows(kernel), atol=1e-12
                )
            elif spec["type"] == "dense":
                np.testing.assert_allclose(
                    _rows(inputs).T @ dz, grads[index]["kernel"], atol=1e-12
                )
            else:
                one_hot = np.eye(spec["input_dim"])[inputs.ravel()]
                np.testing.assert_allclose(
                    one_hot.T @ dz, grads[index]["embeddings"], atol=1e-12
                )
            if "bias" in grads[index]:
                np.testing.assert_allclose(
                    dz.sum(axis=0), grads[index]["bias"], atol=1e-12
                )

    def test_mse_is_the_weighted_mean_over_outputs_and_batch(self):
        rng = np.random.default_rng(3)
        model, weights, x, y, _ = mse_case(rng)
        sample_weight = rng.uniform(0.2, 2.0, len(x))
        predictions = reference.predict(model, weights, x)
        expected = np.sum(
            sample_weight * ((predictions - y) ** 2).mean(axis=1)
        ) / len(x)
        actual = _loss(model, weights, x, y, "mse", sample_weight)
        np.testing.assert_allclose(actual, expected, rtol=1e-13)

    def test_loss_scale_is_an_identity(self):
        model, weights, x, y, loss = embedding_case(np.random.default_rng(4))
        plain = reference.forward_backward(model, weights, x, y, loss)
        scaled = reference.forward_backward(
            model, weights, x, y, loss, loss_scale=1024.0
        )
        assert plain[0] == scaled[0]
        for layer, scaled_layer in zip(plain[1], scaled[1]):
            for name in layer:
                np.testing.assert_allclose(
                    layer[name], scaled_layer[name], rtol=1e-14
                )


def brute_geometry(size, kernel, stride, padding, dilation):
    """(output size, leading pad) of one axis, as TensorFlow documents."""
    span = (kernel - 1) * dilation + 1
    if padding == "valid":
        return math.ceil((size - span + 1) / stride), 0
    output = math.ceil(size / stride)
    return output, max((output - 1) * stride + span - size, 0) // 2


def brute_im2col(x, kernel_size, strides, padding, dilation):
    """im2col by loops over output positions and kernel taps."""
    n, h, w, c = x.shape
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, strides, dilation
    ho, top = brute_geometry(h, kh, sh, padding, dh)
    wo, left = brute_geometry(w, kw, sw, padding, dw)
    patches = np.zeros((n, ho, wo, kh, kw, c))
    for e, p, q, i, j in np.ndindex(n, ho, wo, kh, kw):
        row, col = p * sh + i * dh - top, q * sw + j * dw - left
        if 0 <= row < h and 0 <= col < w:
            patches[e, p, q, i, j] = x[e, row, col]
    return patches.reshape(n * ho * wo, -1), (ho, wo)


def brute_conv(x, kernel, strides, padding, dilation):
    """A direct convolution: one output element at a time."""
    n, h, w, _ = x.shape
    kh, kw, _, filters = kernel.shape
    (sh, sw), (dh, dw) = strides, dilation
    ho, top = brute_geometry(h, kh, sh, padding, dh)
    wo, left = brute_geometry(w, kw, sw, padding, dw)
    out = np.zeros((n, ho, wo, filters))
    for e, p, q in np.ndindex(n, ho, wo):
        for i, j in np.ndindex(kh, kw):
            row, col = p * sh + i * dh - top, q * sw + j * dw - left
            if 0 <= row < h and 0 <= col < w:
                out[e, p, q] += x[e, row, col] @ kernel[i, j]
    return out


CONV_GEOMETRIES = [
    ((3, 3), (1, 1), "same", (1, 1)),
    ((3, 3), (2, 2), "valid", (1, 1)),
    ((3, 2), (2, 1), "same", (2, 2)),
    ((2, 2), (1, 1), "same", (1, 1)),
    ((2, 3), (3, 2), "same", (1, 2)),
    ((3, 3), (1, 2), "valid", (2, 1)),
    ((1, 1), (2, 2), "same", (1, 1)),
]


class TestIm2col:
    @pytest.mark.parametrize("geometry", CONV_GEOMETRIES)
    def test_matches_the_loops(self, geometry):
        x = np.random.default_rng(5).normal(size=(2, 7, 6, 3))
        patches, shape = reference.im2col(x, *geometry)
        expected, expected_shape = brute_im2col(x, *geometry)
        assert shape == expected_shape
        np.testing.assert_array_equal(patches, expected)

    @pytest.mark.parametrize("geometry", CONV_GEOMETRIES)
    def test_patches_times_kernel_is_the_convolution(self, geometry):
        rng = np.random.default_rng(6)
        x = rng.normal(size=(2, 7, 6, 3))
        kernel = rng.normal(size=(*geometry[0], 3, 4))
        patches, (ho, wo) = reference.im2col(x, *geometry)
        actual = (patches @ kernel.reshape(-1, 4)).reshape(2, ho, wo, 4)
        kernel_size, strides, padding, dilation = geometry
        expected = brute_conv(x, kernel, strides, padding, dilation)
        np.testing.assert_allclose(actual, expected, atol=1e-12)
        layer = _conv(4, kernel_size, strides, padding, dilation, "linear")
        layer["use_bias"] = False
        output = reference.predict([layer], [{"kernel": kernel}], x)
        np.testing.assert_allclose(output, expected, atol=1e-12)

    def test_same_padding_puts_the_odd_pad_at_the_end(self):
        """TensorFlow pads [0, 1] for a width-2 kernel: [0+1, 1+2, 2+3, 3+0]."""
        x = np.arange(4.0).reshape(1, 1, 4, 1)
        patches, shape = reference.im2col(x, (1, 2), (1, 1), "same", (1, 1))
        assert shape == (1, 4)
        np.testing.assert_array_equal(patches.sum(axis=1), [1, 3, 5, 3])

    @pytest.mark.parametrize(
        "size, kernel, stride, padding, dilation, expected",
        [
            (7, 3, 2, "same", 1, (4, 1, 1)),
            (7, 3, 2, "valid", 1, (3, 0, 0)),
            (6, 3, 2, "same", 1, (3, 0, 1)),
            (7, 3, 2, "same", 2, (4, 2, 2)),
            (5, 3, 1, "valid", 2, (1, 0, 0)),
        ],
    )
    def test_axis_geometry(
        self, size, kernel, stride, padding, dilation, expected
    ):
        actual = reference.conv_axis_geometry(
            size, kernel, stride, padding, dilation
        )
        assert actual == expected


def _spd(rng, dim):
    factor = rng.normal(size=(dim, dim))
    return factor @ factor.T + dim * np.eye(dim)


class TestBlockInverse:
    @pytest.mark.parametrize("split_dim", [7, 10, 128])
    def test_exact_inverse_when_split_dim_covers_the_matrix(self, split_dim):
        matrix = _spd(np.random.default_rng(7), 7)
        np.testing.assert_allclose(
            reference.block_inverse(matrix, split_dim),
            np.linalg.inv(matrix),
            atol=1e-14,
        )

    @pytest.mark.parametrize("split_dim", [1, 2, 3, 4, 6])
    def test_blocks_invert_the_diagonal_blocks(self, split_dim):
        dim = 7
        matrix = _spd(np.random.default_rng(8), dim)
        inverse = reference.block_inverse(matrix, split_dim)
        starts = range(0, dim, split_dim)
        block_of = np.arange(dim) // split_dim
        off_block = block_of[:, None] != block_of[None, :]
        assert np.all(inverse[off_block] == 0.0)
        for start in starts:
            block = slice(start, min(start + split_dim, dim))
            size = block.stop - block.start
            np.testing.assert_allclose(
                inverse[block, block] @ matrix[block, block],
                np.eye(size),
                atol=1e-13,
            )
        last = slice(starts[-1], dim)
        assert last.stop - last.start == dim - split_dim * (len(starts) - 1)


def _linear_regression(rng, units):
    x = rng.normal(size=(20, 4))
    y = rng.normal(size=(20, units))
    kernel = rng.normal(size=(4, units))
    return x, y, kernel


def _one_thor_step(model, weights, x, y, loss, **hyper):
    return reference.run_reference(model, weights, [(x, y)], loss, **hyper)[0]


class TestGaussNewton:
    """One THOR step on a bias-free linear model with MSE, full batch.

    With k outputs, residuals R = XW - Y and L = mean(R**2): the gradient
    is g = 2 X^T R / (kN) and dz = 2R / (kN), so D = N dz = 2R / k,
    A = X^T X / N and G = D^T D / N = 4 R^T R / (k^2 N). With damping -> 0,
    lr = 1 and no momentum the THOR step is

        W - A^-1 g G^-1 = W - (X^T X)^-1 X^T R S^-1,  S = 2 R^T R / (kN),

    the exact Newton (= Gauss-Newton) step (X^T X)^-1 X^T R right-multiplied
    by S^-1: THOR's G is the empirical Fisher 4 R^T R / (k^2 N), where
    Newton has the per-example output Hessian 2/k I, and S^-1 = (2/k) G^-1.
    For one output S = 2L: the THOR step is the Newton step divided by 2L.
    """

    # sqrt(damping) = 1e-10 shifts A and G; 1e-10 itself would shift them by
    # 1e-5, a relative 1e-4 on the step.
    HYPER = {"learning_rate": 1.0, "momentum": 0.0, "damping": 1e-20}

    @pytest.mark.parametrize("units", [1, 3])
    def test_step_is_the_newton_step_times_s_inverse(self, units):
        x, y, kernel = _linear_regression(np.random.default_rng(9), units)
        model = [_dense(units, use_bias=False)]
        new = _one_thor_step(
            model, [{"kernel": kernel}], x, y, "mse", **self.HYPER
        )
        residuals = x @ kernel - y
        newton = np.linalg.solve(x.T @ x, x.T @ residuals)
        s_matrix = 2 * residuals.T @ residuals / (units * len(x))
        expected = kernel - newton @ np.linalg.inv(s_matrix)
        np.testing.assert_allclose(new[0]["kernel"], expected, rtol=1e-8)

    def test_one_output_step_is_the_newton_step_over_twice_the_loss(self):
        x, y, kernel = _linear_regression(np.random.default_rng(10), 1)
        model = [_dense(1, use_bias=False)]
        new = _one_thor_step(
            model, [{"kernel": kernel}], x, y, "mse", **self.HYPER
        )
        residuals = x @ kernel - y
        loss = np.mean(residuals**2)
        newton = np.linalg.solve(x.T @ x, x.T @ residuals)
        np.testing.assert_allclose(
            new[0]["kernel"], kernel - newton / (2 * loss), rtol=1e-8
        )


def _batches(rng, count, n=6):
    return [(rng.normal(size=(n, 4)), _labels(rng, n, 3)) for _ in range(count)]


class TestFactors:
    def test_dense_on_sequences_counts_every_position(self):
        model, weights, x, y, loss = embedding_case(np.random.default_rng(11))
        _, _, captures = reference.forward_backward(model, weights, x, y, loss)
        inputs, dz = captures[2]["inputs"], captures[2]["output_grad"]
        a, g, c = reference.thor_factors(model[2], inputs, dz, len(x))
        rows_x, rows_d = _rows(inputs), len(x) * _rows(dz)
        assert len(rows_x) == 3 * 4 and c == 1.0
        np.testing.assert_allclose(a, rows_x.T @ rows_x / 12, atol=1e-14)
        np.testing.assert_allclose(g, rows_d.T @ rows_d / 12, atol=1e-14)

    def test_conv_factors_use_the_patches_and_sqrt_positions(self):
        model, weights, x, y, loss = cnn_case(np.random.default_rng(12))
        _, _, captures = reference.forward_backward(model, weights, x, y, loss)
        spec, capture = model[1], captures[1]
        a, g, c = reference.thor_factors(
            spec, capture["inputs"], capture["output_grad"], len(x)
        )
        patches, (ho, wo) = reference.im2col(
            capture["inputs"], (3, 3), (2, 2), "valid", (1, 1)
        )
        rows_d = len(x) * _rows(capture["output_grad"])
        rows = len(x) * ho * wo
        assert (ho, wo) == (2, 2) and c == 2.0
        np.testing.assert_allclose(a, patches.T @ patches / rows, atol=1e-14)
        np.testing.assert_allclose(g, rows_d.T @ rows_d / rows, atol=1e-14)

    def test_inverses_add_the_square_root_of_the_damping(self):
        spec = {"type": "conv2d"}
        a, g = _spd(np.random.default_rng(13), 5), np.eye(2)
        inverses = reference.layer_inverses(spec, (a, g, 3.0), 0.04, 2)
        expected = reference.block_inverse(3.0 * a + 0.2 * np.eye(5), 2)
        np.testing.assert_allclose(inverses["A_inv"], expected, atol=1e-14)
        np.testing.assert_allclose(inverses["G_inv"], np.eye(2) / 3.2)


class TestFrequency:
    def test_refreshes_at_multiples_of_the_frequency(self):
        rng = np.random.default_rng(14)
        model, weights, *_ = mlp_case(rng)
        optimizer = reference.ReferenceTHOR(
            model, CE, frequency=3, damping=[0.1, 0.5, 0.7, 0.2, 0.3, 0.9, 0.4]
        )
        stored = []
        for x, y in _batches(rng, 7):
            weights = optimizer.step(weights, x, y)
            stored.append(dict(optimizer.inverses))
        assert optimizer.refresh_steps == [0, 3, 6]
        assert optimizer.refreshes == 3 and optimizer.iterations == 7
        for step in (1, 2, 4, 5):
            for index in (0, 1):
                assert stored[step][index] is stored[step - 1][index]
        for step in (3, 6):
            assert stored[step][0] is not stored[step - 1][0]

    def test_stored_inverses_keep_the_refresh_step_damping(self):
        rng = np.random.default_rng(15)
        model, weights, *_ = mlp_case(rng)
        batches = _batches(rng, 3)
        optimizer = reference.ReferenceTHOR(
            model, CE, frequency=4, damping=[0.1, 5.0, 7.0]
        )
        new = weights
        for x, y in batches:
            new = optimizer.step(new, x, y)
        x, y = batches[0]
        _, _, captures = reference.forward_backward(model, weights, x, y, CE)
        for index, capture in captures.items():
            factors = reference.thor_factors(
                model[index], capture["inputs"], capture["output_grad"], 6
            )
            expected = reference.layer_inverses(model[index], factors, 0.1, 128)
            for name in ("A_inv", "G_inv"):
                np.testing.assert_allclose(
                    optimizer.inverses[index][name], expected[name], atol=1e-14
                )

    def test_non_refresh_steps_precondition_with_the_stored_inverses(self):
        rng = np.random.default_rng(16)
        model, weights, *_ = mlp_case(rng)
        optimizer = reference.ReferenceTHOR(
            model, CE, learning_rate=0.5, momentum=0.0, frequency=5
        )
        (x0, y0), (x1, y1) = _batches(rng, 2)
        after_first = optimizer.step(weights, x0, y0)
        inverses = dict(optimizer.inverses)
        after_second = optimizer.step(after_first, x1, y1)
        assert all(optimizer.inverses[i] is inverses[i] for i in (0, 1))
        _, grads, _ = reference.forward_backward(model, after_first, x1, y1, CE)
        for index, layer in enumerate(after_first):
            for name, value in layer.items():
                update = reference.precondition(
                    model[index],
                    name,
                    grads[index][name],
                    inverses[index],
                    0.03,
                    32,
                )
                np.testing.assert_allclose(
                    after_second[index][name], value - 0.5 * update, atol=1e-14
                )


class TestSchedules:
    def test_sequences_are_indexed_by_the_step(self):
        rng = np.random.default_rng(17)
        model, weights, *_ = mlp_case(rng)
        batches = _batches(rng, 3)
        hyper = {"momentum": 0.0, "frequency": 2}
        listed = reference.run_reference(
            model,
            weights,
            batches,
            CE,
            learning_rate=[0.1, 0.0, 0.2],
            damping=[0.03, 0.5, 0.03],
            **hyper,
        )
        for name in ("kernel", "bias"):
            np.testing.assert_array_equal(
                listed[1][0][name], listed[0][0][name]
            )
        scalar = reference.run_reference(
            model, weights, batches[:1], CE, learning_rate=0.1, **hyper
        )
        np.testing.assert_allclose(
            listed[0][0]["kernel"], scalar[0][0]["kernel"], rtol=1e-15
        )

    @pytest.mark.parametrize("name", ["learning_rate", "damping"])
    def test_too_short_a_sequence_raises(self, name):
        rng = np.random.default_rng(18)
        model, weights, *_ = mlp_case(rng)
        optimizer = reference.ReferenceTHOR(model, CE, **{name: [0.1, 0.1]})
        batches = _batches(rng, 3)
        for x, y in batches[:2]:
            weights = optimizer.step(weights, x, y)
        with pytest.raises(ValueError, match=name):
            optimizer.step(weights, *batches[2])


class TestUpdateRule:
    @pytest.mark.parametrize("use_nesterov", [False, True])
    @pytest.mark.parametrize("enable_clip_grad", [False, True])
    @pytest.mark.parametrize("decay_bias", [False, True])
    def test_biases_follow_apply_momentum(
        self, use_nesterov, enable_clip_grad, decay_bias
    ):
        """Biases are not preconditioned: decay, clip, then ApplyMomentum."""
        rng = np.random.default_rng(19)
        model, weights, *_ = mlp_case(rng)
        lr, mu, wd = 0.3, 0.9, 0.05
        optimizer = reference.ReferenceTHOR(
            model,
            CE,
            learning_rate=lr,
            momentum=mu,
            weight_decay=wd,
            decay_filter=lambda index, name: decay_bias or name != "bias",
            use_nesterov=use_nesterov,
            enable_clip_grad=enable_clip_grad,
        )
        heavy = np.full(4, 20.0)  # sample weights that make clipping bite
        velocity = np.zeros(3)
        for x, y in _batches(rng, 3, n=4):
            _, grads, _ = reference.forward_backward(
                model, weights, x, y, CE, heavy
            )
            bias = weights[1]["bias"]
            grad = grads[1]["bias"] + (wd * bias if decay_bias else 0.0)
            if enable_clip_grad:
                assert np.linalg.norm(grad) > 1.0
                grad = grad / np.linalg.norm(grad)
            velocity = mu * velocity + grad
            step = grad + mu * velocity if use_nesterov else velocity
            weights = optimizer.step(weights, x, y, heavy)
            np.testing.assert_allclose(
                weights[1]["bias"], bias - lr * step, atol=1e-14
            )

    def test_layer_norm_uses_this_steps_damping(self):
        rng = np.random.default_rng(20)
        model, weights, x, y, loss = embedding_case(rng)
        optimizer = reference.ReferenceTHOR(
            model,
            loss,
            learning_rate=0.2,
            momentum=0.0,
            damping=[0.1, 0.4],
            batch_size=8,
        )
        weights = optimizer.step(weights, x, y)
        _, grads, _ = reference.forward_backward(model, weights, x, y, loss)
        new = optimizer.step(weights, x, y)
        for name in ("gamma", "beta"):
            grad = grads[1][name]
            update = grad / (grad**2 / 8 + math.sqrt(0.4))
            np.testing.assert_allclose(
                new[1][name], weights[1][name] - 0.2 * update, atol=1e-14
            )

    def test_loss_scale_leaves_the_steps_unchanged(self):
        rng = np.random.default_rng(21)
        model, weights, *_ = cnn_case(rng)
        batches = [
            (rng.normal(size=(2, 6, 6, 2)), _labels(rng, 2, 3)) for _ in "ab"
        ]
        plain = reference.run_reference(model, weights, batches, CE)
        scaled = reference.run_reference(
            model, weights, batches, CE, loss_scale=128.0
        )
        for layer, scaled_layer in zip(plain[-1], scaled[-1]):
            for name in layer:
                np.testing.assert_allclose(
                    layer[name], scaled_layer[name], rtol=1e-12
                )


class TestEmbeddingIsDenseOnOneHot:
    VOCAB, DIM, LENGTH = 5, 3, 4

    def _models(self, rng):
        ids = rng.integers(0, self.VOCAB, size=(6, self.LENGTH))
        labels = _labels(rng, 6, 2)
        table = rng.normal(size=(self.VOCAB, self.DIM))
        head = _kernel_and_bias(rng, (self.LENGTH * self.DIM, 2))
        embedding = [
            {"type": "embedding", "input_dim": self.VOCAB, "output_dim": 3},
            {"type": "flatten"},
            _dense(2),
        ]
        dense = [_dense(self.DIM, use_bias=False), *embedding[1:]]
        return (
            (embedding, [{"embeddings": table}, {}, head], ids),
            (dense, [{"kernel": table}, {}, head], np.eye(self.VOCAB)[ids]),
            labels,
        )

    def test_factors_and_preconditioned_gradient(self):
        embedding, dense, labels = self._models(np.random.default_rng(22))
        results = []
        for model, weights, x in (embedding, dense):
            _, grads, captures = reference.forward_backward(
                model, weights, x, labels, CE
            )
            capture = captures[0]
            factors = reference.thor_factors(
                model[0], capture["inputs"], capture["output_grad"], 6
            )
            inverses = reference.layer_inverses(model[0], factors, 0.03, 2)
            name = reference.THOR_KERNELS[model[0]["type"]]
            grad = grads[0][name]
            update = reference.precondition(
                model[0], name, grad, inverses, 0.03, 32
            )
            results.append((factors, inverses, grad, update))
        (a, g_e, _), inv_e, grad_e, update_e = results[0]
        (a_dense, g_d, _), inv_d, grad_d, update_d = results[1]
        np.testing.assert_allclose(a, np.diag(a_dense), atol=1e-15)
        np.testing.assert_array_equal(a_dense, np.diag(np.diag(a_dense)))
        np.testing.assert_allclose(g_e, g_d, atol=1e-14)
        np.testing.assert_allclose(grad_e, grad_d, atol=1e-14)
        np.testing.assert_allclose(
            update_e, np.diag(inv_e["A_inv"]) @ grad_e @ inv_e["G_inv"]
        )
        np.testing.assert_allclose(update_e, update_d, atol=1e-13)
        np.testing.assert_allclose(
            np.diag(inv_d["A_inv"]), inv_e["A_inv"], atol=1e-14
        )

    def test_thor_runs_agree(self):
        rng = np.random.default_rng(23)
        embedding, dense, labels = self._models(rng)
        hyper = {"frequency": 2, "split_dim": 2, "learning_rate": 0.1}
        runs = [
            reference.run_reference(
                model, weights, [(x, labels)] * 3, CE, **hyper
            )
            for model, weights, x in (embedding, dense)
        ]
        np.testing.assert_allclose(
            runs[0][-1][0]["embeddings"], runs[1][-1][0]["kernel"], atol=1e-12
        )
        np.testing.assert_allclose(
            runs[0][-1][2]["kernel"], runs[1][-1][2]["kernel"], atol=1e-12
        )
