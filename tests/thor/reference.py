"""A NumPy float64 reference of THOR (MindSpore's `nn.thor`, per sample).

Independent of Keras: the forward and backward passes of the small
Sequential models below are written out by hand, so that the tests can check
the Keras optimizer against it step by step.

A model is a list of layer specs (dicts with a "type"); its weights are a
list with one dict per layer (empty for weightless layers), in Keras layouts.
The THOR layers are dense, conv2d and embedding; their stored inverses are
`{"A_inv": ..., "G_inv": ...}`, where an embedding's `A_inv` is the vector
`a_inv`, the diagonal of its diagonal A inverse.
"""

import math

import numpy as np

THOR_LAYERS = ("dense", "conv2d", "embedding")
THOR_KERNELS = {
    "dense": "kernel",
    "conv2d": "kernel",
    "embedding": "embeddings",
}
LOSSES = ("mse", "sparse_categorical_crossentropy_from_logits")


# Activations.


def _activate(name, pre_activation):
    """The activation `name` of the pre-activation."""
    if name == "linear":
        return pre_activation
    if name == "relu":
        return np.maximum(pre_activation, 0.0)
    if name == "tanh":
        return np.tanh(pre_activation)
    raise ValueError(f"unknown activation {name!r}")


def _activation_backward(name, pre_activation, output, output_grad):
    """The gradient w.r.t. the pre-activation, from that w.r.t. the output."""
    if name == "linear":
        return output_grad
    if name == "relu":
        return output_grad * (pre_activation > 0)
    if name == "tanh":
        return output_grad * (1.0 - output**2)
    raise ValueError(f"unknown activation {name!r}")


# Convolution geometry, exactly TensorFlow's.


def _pair(value):
    """An int or a pair, as a pair of ints."""
    if np.ndim(value) == 0:
        return int(value), int(value)
    first, second = value
    return int(first), int(second)


def conv_axis_geometry(size, kernel, stride, padding, dilation):
    """(output size, padding before, padding after) of one spatial axis."""
    span = (kernel - 1) * dilation + 1
    if padding == "valid":
        return -(-(size - span + 1) // stride), 0, 0
    if padding == "same":
        output = -(-size // stride)
        total = max((output - 1) * stride + span - size, 0)
        return output, total // 2, total - total // 2
    raise ValueError(f"unknown padding {padding!r}")


def _conv_geometry(input_shape, kernel_size, strides, padding, dilation_rate):
    """The per-axis geometry of the two spatial axes of NHWC inputs."""
    return [
        conv_axis_geometry(size, kernel, stride, padding, dilation)
        for size, kernel, stride, dilation in zip(
            input_shape[1:3],
            _pair(kernel_size),
            _pair(strides),
            _pair(dilation_rate),
        )
    ]


def _tap_windows(kernel_size, strides, dilation_rate, output_hw):
    """Per kernel tap, in (kh, kw) order, its window of the padded input."""
    (kh, kw), (sh, sw) = _pair(kernel_size), _pair(strides)
    (dh, dw), (ho, wo) = _pair(dilation_rate), output_hw
    return [
        (
            slice(None),
            slice(i * dh, i * dh + (ho - 1) * sh + 1, sh),
            slice(j * dw, j * dw + (wo - 1) * sw + 1, sw),
            slice(None),
        )
        for i in range(kh)
        for j in range(kw)
    ]


def im2col(inputs, kernel_size, strides, padding, dilation_rate):
    """The patches (N*Ho*Wo, kh*kw*C_in), in (kh, kw, C_in) order; (Ho, Wo).

    Row n*Ho*Wo + p*Wo + q is the patch of output position (p, q) of
    example n, zero-padded as TensorFlow pads.
    """
    inputs = np.asarray(inputs, np.float64)
    (ho, top, bottom), (wo, left, right) = _conv_geometry(
        inputs.shape, kernel_size, strides, padding, dilation_rate
    )
    padded = np.pad(inputs, ((0, 0), (top, bottom), (left, right), (0, 0)))
    windows = _tap_windows(kernel_size, strides, dilation_rate, (ho, wo))
    patches = np.stack([padded[window] for window in windows], axis=3)
    return patches.reshape(inputs.shape[0] * ho * wo, -1), (ho, wo)


def _col2im(patch_grads, input_shape, kernel_size, strides, padding, dilation):
    """The adjoint of `im2col`: patch gradients summed back onto the input."""
    (ho, top, bottom), (wo, left, right) = _conv_geometry(
        input_shape, kernel_size, strides, padding, dilation
    )
    n, h, w, c = input_shape
    padded = np.zeros((n, h + top + bottom, w + left + right, c))
    taps = patch_grads.reshape(n, ho, wo, -1, c)
    windows = _tap_windows(kernel_size, strides, dilation, (ho, wo))
    for tap, window in enumerate(windows):
        padded[window] += taps[:, :, :, tap, :]
    return padded[:, top : top + h, left : left + w, :]


# Layers: forward(spec, weights, inputs) -> (outputs, cache);
# backward(spec, weights, cache, output_grad) -> (input_grad, grads, dz).


def _dense_forward(spec, weights, inputs):
    pre_activation = inputs @ weights["kernel"]
    if spec.get("use_bias", True):
        pre_activation = pre_activation + weights["bias"]
    outputs = _activate(spec.get("activation", "linear"), pre_activation)
    return outputs, {"inputs": inputs, "s": pre_activation, "out": outputs}


def _dense_backward(spec, weights, cache, output_grad):
    dz = _activation_backward(
        spec.get("activation", "linear"), cache["s"], cache["out"], output_grad
    )
    inputs = cache["inputs"]
    dz_rows = dz.reshape(-1, dz.shape[-1])
    grads = {"kernel": inputs.reshape(-1, inputs.shape[-1]).T @ dz_rows}
    if spec.get("use_bias", True):
        grads["bias"] = dz_rows.sum(axis=0)
    return dz @ weights["kernel"].T, grads, dz


def _conv_args(spec):
    """The (kernel_size, strides, padding, dilation_rate) of a conv2d spec."""
    return (
        _pair(spec["kernel_size"]),
        _pair(spec.get("strides", 1)),
        spec.get("padding", "valid"),
        _pair(spec.get("dilation_rate", 1)),
    )


def _conv2d_forward(spec, weights, inputs):
    kernel = weights["kernel"]
    patches, (ho, wo) = im2col(inputs, *_conv_args(spec))
    rows = patches @ kernel.reshape(-1, kernel.shape[-1])
    pre_activation = rows.reshape(inputs.shape[0], ho, wo, kernel.shape[-1])
    if spec.get("use_bias", True):
        pre_activation = pre_activation + weights["bias"]
    outputs = _activate(spec.get("activation", "linear"), pre_activation)
    cache = {
        "inputs": inputs,
        "patches": patches,
        "s": pre_activation,
        "out": outputs,
    }
    return outputs, cache


def _conv2d_backward(spec, weights, cache, output_grad):
    dz = _activation_backward(
        spec.get("activation", "linear"), cache["s"], cache["out"], output_grad
    )
    kernel = weights["kernel"]
    kernel_rows = kernel.reshape(-1, kernel.shape[-1])
    dz_rows = dz.reshape(-1, kernel.shape[-1])
    grads = {"kernel": (cache["patches"].T @ dz_rows).reshape(kernel.shape)}
    if spec.get("use_bias", True):
        grads["bias"] = dz_rows.sum(axis=0)
    input_grad = _col2im(
        dz_rows @ kernel_rows.T, cache["inputs"].shape, *_conv_args(spec)
    )
    return input_grad, grads, dz


def _embedding_forward(spec, weights, inputs):
    ids = np.asarray(inputs).astype(np.int64)
    return weights["embeddings"][ids], {"ids": ids}


def _embedding_backward(spec, weights, cache, output_grad):
    grad = np.zeros_like(weights["embeddings"])
    rows = output_grad.reshape(-1, grad.shape[1])
    np.add.at(grad, cache["ids"].ravel(), rows)
    return None, {"embeddings": grad}, output_grad


def _layer_norm_forward(spec, weights, inputs):
    mean = inputs.mean(axis=-1, keepdims=True)
    inv_std = 1.0 / np.sqrt(inputs.var(axis=-1, keepdims=True) + _eps(spec))
    normalized = (inputs - mean) * inv_std
    outputs = weights["gamma"] * normalized + weights["beta"]
    return outputs, {"normalized": normalized, "inv_std": inv_std}


def _eps(spec):
    """A LayerNormalization's epsilon, Keras's default 1e-3."""
    return spec.get("epsilon", 1e-3)


def _layer_norm_backward(spec, weights, cache, output_grad):
    normalized = cache["normalized"]
    leading = tuple(range(output_grad.ndim - 1))
    grads = {
        "gamma": (output_grad * normalized).sum(axis=leading),
        "beta": output_grad.sum(axis=leading),
    }
    dnorm = output_grad * weights["gamma"]
    input_grad = cache["inv_std"] * (
        dnorm
        - dnorm.mean(axis=-1, keepdims=True)
        - normalized * (dnorm * normalized).mean(axis=-1, keepdims=True)
    )
    return input_grad, grads, None


def _flatten_forward(spec, weights, inputs):
    return inputs.reshape(inputs.shape[0], -1), {"shape": inputs.shape}


def _flatten_backward(spec, weights, cache, output_grad):
    return output_grad.reshape(cache["shape"]), {}, None


def _pooling_axes(spec):
    """The averaged axes of a global average pooling layer."""
    return (1,) if spec["type"] == "global_average_pooling1d" else (1, 2)


def _pooling_forward(spec, weights, inputs):
    outputs = inputs.mean(axis=_pooling_axes(spec))
    return outputs, {"shape": inputs.shape}


def _pooling_backward(spec, weights, cache, output_grad):
    axes = _pooling_axes(spec)
    count = math.prod(cache["shape"][axis] for axis in axes)
    spread = np.expand_dims(output_grad, axes) / count
    return np.broadcast_to(spread, cache["shape"]), {}, None


LAYERS = {
    "dense": (_dense_forward, _dense_backward),
    "conv2d": (_conv2d_forward, _conv2d_backward),
    "embedding": (_embedding_forward, _embedding_backward),
    "layer_norm": (_layer_norm_forward, _layer_norm_backward),
    "flatten": (_flatten_forward, _flatten_backward),
    "global_average_pooling1d": (_pooling_forward, _pooling_backward),
    "global_average_pooling2d": (_pooling_forward, _pooling_backward),
}


# Losses, reduced as Keras's "sum_over_batch_size".


def _example_losses(loss, predictions, targets):
    """Per-example losses and their gradients w.r.t. the predictions."""
    if loss == "mse":
        diff = predictions - np.reshape(targets, predictions.shape)
        return (diff**2).mean(axis=-1), 2.0 * diff / diff.shape[-1]
    if loss == "sparse_categorical_crossentropy_from_logits":
        labels = np.reshape(targets, predictions.shape[:-1]).astype(np.int64)
        shifted = predictions - predictions.max(axis=-1, keepdims=True)
        log_norm = np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
        log_probs = shifted - log_norm
        one_hot = np.eye(predictions.shape[-1])[labels]
        return -(log_probs * one_hot).sum(axis=-1), np.exp(log_probs) - one_hot
    raise ValueError(f"unknown loss {loss!r}; expected one of {LOSSES}")


def loss_and_gradient(loss, predictions, targets, sample_weight=None):
    """The reduced loss, sum(w_n * l_n) / N, and its prediction gradient."""
    losses, grads = _example_losses(loss, predictions, targets)
    weights = np.ones_like(losses)
    if sample_weight is not None:
        per_example = np.asarray(sample_weight, np.float64)
        weights = weights * per_example.reshape(-1, *[1] * (losses.ndim - 1))
    value = float((weights * losses).sum() / losses.size)
    return value, (weights / losses.size)[..., None] * grads


# Forward and backward through a model.


def _as_float64(weights):
    """A copy of the weights list with every array in float64."""
    return [
        {name: np.array(value, np.float64) for name, value in layer.items()}
        for layer in weights
    ]


def _forward(model, weights, x):
    """(outputs, the input of every layer, the cache of every layer)."""
    inputs = np.asarray(x)
    if model[0]["type"] != "embedding":
        inputs = inputs.astype(np.float64)
    layer_inputs, caches = [], []
    for spec, layer_weights in zip(model, weights):
        layer_inputs.append(inputs)
        inputs, cache = LAYERS[spec["type"]][0](spec, layer_weights, inputs)
        caches.append(cache)
    return inputs, layer_inputs, caches


def predict(model, weights, x):
    """The model's outputs on x."""
    return _forward(model, _as_float64(weights), x)[0]


def forward_backward(
    model, weights, x, y, loss, sample_weight=None, loss_scale=1.0
):
    """(loss value, weight gradients, captures of the THOR layers).

    `captures[i]` for each THOR layer index i is `{"inputs": its input,
    "output_grad": dz}`, dz the gradient of the reduced loss w.r.t. its
    pre-activation (an embedding's output). The backward pass starts from
    `loss_scale` and every gradient is divided by it afterwards.
    """
    weights = _as_float64(weights)
    outputs, layer_inputs, caches = _forward(model, weights, x)
    value, output_grad = loss_and_gradient(loss, outputs, y, sample_weight)
    output_grad = output_grad * loss_scale
    grads, captures = [None] * len(model), {}
    for index in reversed(range(len(model))):
        spec = model[index]
        output_grad, layer_grads, dz = LAYERS[spec["type"]][1](
            spec, weights[index], caches[index], output_grad
        )
        grads[index] = {
            name: grad / loss_scale for name, grad in layer_grads.items()
        }
        if spec["type"] in THOR_LAYERS:
            captures[index] = {
                "inputs": layer_inputs[index],
                "output_grad": dz / loss_scale,
            }
    return value, grads, captures


# The THOR rule.


def thor_factors(layer_spec, inputs, output_grad, batch_size_n):
    """(A, or an embedding's vector a; G; the scale c) of one THOR layer."""
    kind = layer_spec["type"]
    width = output_grad.shape[-1]
    scaled = batch_size_n * np.asarray(output_grad, np.float64)
    rows_d = scaled.reshape(-1, width)
    g_factor = rows_d.T @ rows_d / rows_d.shape[0]
    if kind == "dense":
        rows_x = np.asarray(inputs, np.float64).reshape(-1, inputs.shape[-1])
        return rows_x.T @ rows_x / rows_x.shape[0], g_factor, 1.0
    if kind == "conv2d":
        patches, (ho, wo) = im2col(inputs, *_conv_args(layer_spec))
        a_factor = patches.T @ patches / patches.shape[0]
        return a_factor, g_factor, math.sqrt(ho * wo)
    if kind == "embedding":
        ids = np.asarray(inputs).astype(np.int64).ravel()
        counts = np.bincount(ids, minlength=layer_spec["input_dim"])
        return counts / ids.size, g_factor, 1.0
    raise ValueError(f"{kind!r} is not a THOR layer")


def block_inverse(matrix, split_dim):
    """The inverse of the block-diagonal part of `matrix`, blocks of split_dim.

    A matrix of at most split_dim rows is inverted exactly; a larger one is
    cut into diagonal blocks of split_dim (the last one smaller), the
    off-diagonal blocks dropped and each block inverted on its own.
    """
    dim = matrix.shape[0]
    inverse = np.zeros_like(matrix, dtype=np.float64)
    for start in range(0, dim, split_dim):
        block = slice(start, min(start + split_dim, dim))
        inverse[block, block] = np.linalg.inv(matrix[block, block])
    return inverse


def layer_inverses(layer_spec, factors, damping, split_dim):
    """{"A_inv", "G_inv"} of one THOR layer from its `thor_factors`."""
    a_factor, g_factor, scale = factors
    shift = math.sqrt(damping)
    g_inv = block_inverse(
        scale * g_factor + shift * np.eye(len(g_factor)), split_dim
    )
    if layer_spec["type"] == "embedding":
        return {"A_inv": 1.0 / (a_factor + shift), "G_inv": g_inv}
    a_inv = block_inverse(
        scale * a_factor + shift * np.eye(len(a_factor)), split_dim
    )
    return {"A_inv": a_inv, "G_inv": g_inv}


def precondition(layer_spec, weight_name, grad, inverses, damping, batch_size):
    """The preconditioned gradient of one weight.

    `inverses` are the layer's stored inverses (THOR layers only); `damping`
    is this step's, used by the LayerNorm rule only.
    """
    kind = layer_spec["type"]
    if kind in THOR_LAYERS and weight_name == THOR_KERNELS[kind]:
        a_inv, g_inv = inverses["A_inv"], inverses["G_inv"]
        if kind == "embedding":
            return a_inv[:, None] * grad @ g_inv
        rows = grad.reshape(-1, grad.shape[-1])
        return (a_inv @ rows @ g_inv).reshape(grad.shape)
    if kind == "layer_norm":
        return grad / (grad**2 / batch_size + math.sqrt(damping))
    return grad


def clip_by_unit_norm(grad):
    """The tensor scaled down to Frobenius norm 1 if its norm is above 1."""
    norm = np.linalg.norm(grad)
    return grad / norm if norm > 1.0 else grad


def value_at_step(value, step, name):
    """A float hyper-parameter, or entry `step` of a per-step sequence."""
    if np.ndim(value) == 0:
        return float(value)
    values = np.asarray(value, np.float64)
    if values.ndim != 1:
        raise ValueError(f"{name} must be a float or a 1-D sequence")
    if step >= len(values):
        raise ValueError(
            f"{name} has {len(values)} entries; step {step} needs {step + 1}"
        )
    return float(values[step])


class ReferenceTHOR:
    """THOR with its state: momenta, stored inverses and the step count.

    `inverses[i]` holds layer i's stored inverses, `refresh_steps` the
    steps that refreshed them and `iterations` the steps taken so far.
    """

    def __init__(
        self,
        model,
        loss,
        learning_rate=0.01,
        damping=0.03,
        momentum=0.9,
        weight_decay=0.0,
        decay_filter=None,
        use_nesterov=False,
        enable_clip_grad=False,
        frequency=100,
        split_dim=128,
        batch_size=32,
        loss_scale=1.0,
    ):
        if int(frequency) < 2:
            raise ValueError(f"frequency must be at least 2, got {frequency}")
        self.model = model
        self.loss = loss
        self.learning_rate = learning_rate
        self.damping = damping
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.decay_filter = decay_filter or (lambda index, name: True)
        self.use_nesterov = use_nesterov
        self.enable_clip_grad = enable_clip_grad
        self.frequency = int(frequency)
        self.split_dim = int(split_dim)
        self.batch_size = batch_size
        self.loss_scale = loss_scale
        self.iterations = 0
        self.inverses = {}
        self.refresh_steps = []
        self.velocities = None

    @property
    def refreshes(self):
        """How many times the inverses were refreshed so far."""
        return len(self.refresh_steps)

    def step(self, weights, x, y, sample_weight=None):
        """One THOR step on a batch; returns the new weights."""
        step = self.iterations
        learning_rate = value_at_step(self.learning_rate, step, "learning_rate")
        damping = value_at_step(self.damping, step, "damping")
        weights = _as_float64(weights)
        _, grads, captures = forward_backward(
            self.model, weights, x, y, self.loss, sample_weight, self.loss_scale
        )
        if step % self.frequency == 0:
            self._refresh(captures, np.shape(x)[0], damping)
        if self.velocities is None:
            self.velocities = [
                {name: np.zeros_like(w) for name, w in layer.items()}
                for layer in weights
            ]
        new_weights = [{} for _ in weights]
        for index, layer in enumerate(weights):
            for name, weight in layer.items():
                new_weights[index][name] = self._update(
                    index,
                    name,
                    weight,
                    grads[index][name],
                    learning_rate,
                    damping,
                )
        self.iterations += 1
        return new_weights

    def _refresh(self, captures, examples, damping):
        """Recomputes and stores every THOR layer's inverses."""
        for index, capture in captures.items():
            spec = self.model[index]
            factors = thor_factors(
                spec, capture["inputs"], capture["output_grad"], examples
            )
            self.inverses[index] = layer_inverses(
                spec, factors, damping, self.split_dim
            )
        self.refresh_steps.append(self.iterations)

    def _update(self, index, name, weight, grad, learning_rate, damping):
        """Steps 3a-3d for one weight; returns the new weight."""
        grad = precondition(
            self.model[index],
            name,
            grad,
            self.inverses.get(index),
            damping,
            self.batch_size,
        )
        if self.decay_filter(index, name):
            grad = grad + self.weight_decay * weight
        if self.enable_clip_grad:
            grad = clip_by_unit_norm(grad)
        velocity = self.momentum * self.velocities[index][name] + grad
        self.velocities[index][name] = velocity
        if self.use_nesterov:
            return weight - learning_rate * (grad + self.momentum * velocity)
        return weight - learning_rate * velocity


def run_reference(model, weights, batches, loss, **hyper):
    """The weights after every step of THOR over `batches`.

    Each batch is (x, y) or (x, y, sample_weight); `hyper` are the
    `ReferenceTHOR` hyper-parameters.
    """
    optimizer = ReferenceTHOR(model, loss, **hyper)
    history = []
    for batch in batches:
        weights = optimizer.step(weights, *batch)
        history.append(weights)
    return history
