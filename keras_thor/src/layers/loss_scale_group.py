"""`LossScaleGroup`: the segment marker of MindSpore's group loss scaling."""

import keras
from keras import ops

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.utils.validation import check_int


@ops.custom_gradient
def _scale_gradient(x, ratio, probe):
    """`x` forward; the gradient times `ratio`, in at least float32. The
    gradient of `probe` is 1 when the incoming gradient is not finite,
    else 0 (the overflow check of the segment after the marker)."""

    def grad(*args, upstream=None):
        if upstream is None:
            (upstream,) = args
        dtype = keras.backend.standardize_dtype(x.dtype)
        wide = keras.backend.result_type(dtype, "float32")
        scaled = ops.cast(upstream, wide) * ops.cast(ratio, wide)
        overflow = ops.logical_not(ops.all(ops.isfinite(upstream)))
        return (
            ops.cast(scaled, dtype),
            ops.zeros_like(ratio),
            ops.cast(overflow, probe.dtype),
        )

    return x, grad


def check_marker_indices(first, second):
    """Returns `(first, second)` as ints if `second == first + 1 >= 1`."""
    first = check_int("first", first, minimum=0)
    second = check_int("second", second)
    if second != first + 1:
        raise ValueError(
            "Markers must join neighbouring scales: argument `second` must "
            f"be `first + 1` = {first + 1}. Received: first={first}, "
            f"second={second}"
        )
    return first, second


@keras_thor_export
class LossScaleGroup(keras.layers.Layer):
    """The identity, with the gradient rescaled between two loss-scale
    segments: MindSpore's `_DynamicLossScale` marker.

    ```
    forward:   y = x
    backward:  dx = dy · s[first] / s[second]
    ```

    Notation:
        - `s`: the float32 scales of one `GroupLossScaleManager`'s chain of
          markers `(0, 1), (1, 2), ..., (n, n+1)`; `s[0] = s[n+1] = 1` and
          `s[g]` is the scale of group `g − 1` (`1 <= g <= n`).
        - segment `g`: the layers between markers `(g−1, g)` and
          `(g, g+1)`; its backward pass runs at scale `s[g]`, and the
          gradient of the inputs at `s[0] = 1`.

    The marker also tells whether the gradient reaching it from the
    segment after it is finite: the gradient of its `overflow_probe`
    weight (0, never read forward) is 1 when it is not, 0 when it is
    (MindSpore's per-segment overflow status; `GroupLossScale` takes it).

    Where the scales live: each marker owns two non-trainable float32
    scalar weights, `first_scale` (`s[first]`) and `second_scale`
    (`s[second]`). Neighbouring markers each hold a copy of the scale they
    share; `GroupLossScaleManager` writes every copy
    (`set_loss_scale_status`, `assign_scales`). A marker needs no other
    object: `model.save` / `keras.models.load_model`, `clone_model` with
    `set_weights`, and config round trips keep its scales, and
    `GroupLossScaleManager.from_model` gives a loaded model a manager.
    Both start at 1 (an identity backward) until the manager sets them.

    Dtype: the marker computes in float32 (its dtype policy and weights
    are float32, never autocast) and does not cast its inputs: the output
    is the input, in its dtype (float16 under `"mixed_float16"`). The
    gradient is multiplied in float32 (float64 for float64 inputs), then
    cast to the input's dtype.

    Args:
        first: Integer >= 0, the scale index of the segment before the
            marker (on the inputs' side).
        second: Integer, `first + 1`: the segment after it (the loss's
            side).
        manager_name: The name of the manager whose chain the marker is
            in (`from_model` finds markers by it).
    """

    def __init__(
        self, first, second, manager_name="group_loss_scale", **kwargs
    ):
        kwargs.setdefault("dtype", "float32")
        super().__init__(autocast=False, **kwargs)
        self.first, self.second = check_marker_indices(first, second)
        if not isinstance(manager_name, str) or not manager_name:
            raise ValueError(
                "Argument `manager_name` must be a non-empty string. "
                f"Received: manager_name={manager_name!r}"
            )
        self.manager_name = manager_name
        self.supports_masking = True
        self.first_scale = self._scale_weight("first_scale")
        self.second_scale = self._scale_weight("second_scale")
        self.overflow_probe = self._scale_weight("overflow_probe", "zeros")
        self.built = True

    def _scale_weight(self, name, initializer="ones"):
        return self.add_weight(
            name=name,
            shape=(),
            initializer=initializer,
            dtype="float32",
            trainable=False,
            autocast=False,
            # Every replica computes the same scale updates.
            aggregation="only_first_replica",
        )

    def ratio(self):
        """`s[first] / s[second]`, a float32 scalar."""
        return ops.divide(self.first_scale, self.second_scale)

    def call(self, inputs):
        return _scale_gradient(
            inputs,
            ops.stop_gradient(self.ratio()),
            ops.convert_to_tensor(self.overflow_probe),
        )

    def compute_output_spec(self, inputs):
        return keras.KerasTensor(inputs.shape, dtype=inputs.dtype)

    def get_config(self):
        config = super().get_config()
        config.update(
            first=self.first,
            second=self.second,
            manager_name=self.manager_name,
        )
        return config
