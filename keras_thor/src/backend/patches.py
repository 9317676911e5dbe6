"""im2col: the patches a 1-, 2- or 3-D convolution multiplies by its kernel."""

import itertools

import keras
from keras import ops


def image_patches(images, kernel_size, strides, dilation_rate, padding):
    """Patches of channels-last `images`, shape `(N, H_out, W_out, d)`, on
    TensorFlow (`tf.image.extract_patches`, which copies them out).

    Each patch is flattened in `(kh, kw, C_in)` order, the order of a Keras
    kernel `(kh, kw, C_in, C_out)` reshaped to `(d, C_out)`, and taken with
    the convolution's own `padding` (`"same"`/`"valid"`), strides and
    dilation.
    """
    import tensorflow as tf

    return tf.image.extract_patches(
        images,
        sizes=[1, *kernel_size, 1],
        strides=[1, *strides, 1],
        rates=[1, *dilation_rate, 1],
        padding=padding.upper(),
    )


def shifted_patches(inputs, kernel_size, strides, dilation_rate, padding):
    """Patches of channels-last `inputs` `(N, *spatial, C)` of any rank:
    the `K` strided slices of the padded inputs, one per kernel offset,
    concatenated along the channels (so in `(k_1, ..., k_r, C)` order).

    Used off TensorFlow: `keras.ops.image.extract_patches` there is a
    convolution with an identity kernel (`d` output channels, 2-8x slower
    on JAX's CPU for benchmark 2's convolutions); slices only copy. Needs
    static spatial sizes (JAX traces with them). Stacking the slices on a
    new axis instead of concatenating them hung XLA's CPU runtime inside
    THOR's ResNet step (jaxlib 0.10.2: a step waiting forever, idle).
    """
    spatial = inputs.shape[1:-1]
    pads, out_sizes = [(0, 0)], []
    for size, kernel, stride, dilation in zip(
        spatial, kernel_size, strides, dilation_rate
    ):
        span = (kernel - 1) * dilation + 1
        if padding == "same":
            out_size = -(-size // stride)
            total = max((out_size - 1) * stride + span - size, 0)
            pads.append((total // 2, total - total // 2))
        else:
            out_size = (size - span) // stride + 1
            pads.append((0, 0))
        out_sizes.append(out_size)
    padded = ops.pad(inputs, (*pads, (0, 0)))
    slices = []
    for offset in itertools.product(*(range(k) for k in kernel_size)):
        index = tuple(
            slice(k * d, k * d + (n - 1) * s + 1, s)
            for k, d, n, s in zip(offset, dilation_rate, out_sizes, strides)
        )
        slices.append(padded[(slice(None), *index)])
    return ops.concatenate(slices, axis=-1)


def conv_patches(inputs, kernel_size, strides, dilation_rate, padding):
    """Patches of channels-last `inputs` `(N, *spatial, C)`, 1-, 2- or 3-D.

    Returns `(N, *out_spatial, K·C)`: one patch per output position of
    `keras.layers.Conv{r}D` with the same options, flattened in
    `(k_1, ..., k_r, C)` order (a Keras kernel `(k_1, ..., k_r, C, C_out)`
    reshaped to `(K·C, C_out)`).

    Notation:
        - `r = len(kernel_size)`, `K = k_1 ··· k_r`.
        - `padding`: `"valid"`, `"same"` (TensorFlow's, the extra pad after)
          or, for `r = 1`, `"causal"` (`d·(k-1)` zeros before, then valid).

    Off TensorFlow every rank goes through `shifted_patches`. On
    TensorFlow through `image_patches`: 1-D as an image of height 1; 3-D as
    `(k_2, k_3)` patches of each depth slice, then `(k_1, 1)` patches of
    those along depth (padding is per axis, so this is exact).
    """
    rank = len(kernel_size)
    kernel_size, strides = tuple(kernel_size), tuple(strides)
    dilation_rate = tuple(dilation_rate)
    if padding == "causal":
        if rank != 1:
            raise ValueError("`padding='causal'` is only for 1-D convolutions")
        before = dilation_rate[0] * (kernel_size[0] - 1)
        inputs = ops.pad(inputs, ((0, 0), (before, 0), (0, 0)))
        padding = "valid"
    if rank not in (1, 2, 3):
        raise ValueError(f"convolutions of rank {rank} are not supported")
    if keras.backend.backend() != "tensorflow":
        return shifted_patches(
            inputs, kernel_size, strides, dilation_rate, padding
        )
    if rank == 1:
        patches = image_patches(
            ops.expand_dims(inputs, 1),
            (1, *kernel_size),
            (1, *strides),
            (1, *dilation_rate),
            padding,
        )
        return patches[:, 0]
    if rank == 2:
        return image_patches(
            inputs, kernel_size, strides, dilation_rate, padding
        )
    return _volume_patches(inputs, kernel_size, strides, dilation_rate, padding)


def _dims(tensor):
    """The shape of `tensor`: static ints where known, else scalar tensors."""
    dynamic = ops.shape(tensor)
    return [
        d if d is not None else dynamic[i] for i, d in enumerate(tensor.shape)
    ]


def _volume_patches(inputs, kernel_size, strides, dilation_rate, padding):
    """3-D patches from two 2-D passes, in `(k_1, k_2, k_3, C)` order."""
    _, depth, height, width, channels = _dims(inputs)
    planes = image_patches(
        ops.reshape(inputs, (-1, height, width, channels)),
        kernel_size[1:],
        strides[1:],
        dilation_rate[1:],
        padding,
    )
    _, out_height, out_width, plane_size = _dims(planes)
    planes = ops.reshape(
        planes, (-1, depth, out_height * out_width, plane_size)
    )
    patches = image_patches(
        planes,
        (kernel_size[0], 1),
        (strides[0], 1),
        (dilation_rate[0], 1),
        padding,
    )
    _, out_depth, _, patch_size = _dims(patches)
    return ops.reshape(
        patches, (-1, out_depth, out_height, out_width, patch_size)
    )
