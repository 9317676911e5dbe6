"""im2col: the input patches a 2-D convolution multiplies by its kernel."""

import keras
from keras import ops


def image_patches(images, kernel_size, strides, dilation_rate, padding):
    """Patches of channels-last `images`, shape `(N, H_out, W_out, d)`.

    Each patch is flattened in `(kh, kw, C_in)` order, the order of a Keras
    kernel `(kh, kw, C_in, C_out)` reshaped to `(d, C_out)`, and taken with
    the convolution's own `padding` (`"same"`/`"valid"`), strides and
    dilation. TensorFlow copies the patches out directly; other backends
    use `keras.ops.image.extract_patches`, a convolution with an identity
    kernel (the same patches, at the cost of a `d`-channel convolution).
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.image.extract_patches(
            images,
            sizes=[1, *kernel_size, 1],
            strides=[1, *strides, 1],
            rates=[1, *dilation_rate, 1],
            padding=padding.upper(),
        )
    return ops.image.extract_patches(
        images,
        size=kernel_size,
        strides=strides,
        dilation_rate=dilation_rate,
        padding=padding,
        data_format="channels_last",
    )
