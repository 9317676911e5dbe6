"""Small models for the boost tests."""

import keras
import numpy as np


def _bottleneck(x, width, name, project, main_first=False):
    shortcut = x
    if project:
        shortcut = keras.layers.Conv2D(4 * width, 1, name=f"{name}_0_conv")(x)
        shortcut = keras.layers.BatchNormalization(name=f"{name}_0_bn")(
            shortcut
        )
    y = keras.layers.Conv2D(width, 1, name=f"{name}_1_conv")(x)
    y = keras.layers.BatchNormalization(name=f"{name}_1_bn")(y)
    y = keras.layers.ReLU(name=f"{name}_1_relu")(y)
    y = keras.layers.Conv2D(width, 3, padding="same", name=f"{name}_2_conv")(y)
    y = keras.layers.BatchNormalization(name=f"{name}_2_bn")(y)
    y = keras.layers.Activation("relu", name=f"{name}_2_relu")(y)
    y = keras.layers.Conv2D(4 * width, 1, name=f"{name}_3_conv")(y)
    y = keras.layers.BatchNormalization(name=f"{name}_3_bn")(y)
    inputs = [y, shortcut] if main_first else [shortcut, y]
    y = keras.layers.Add(name=f"{name}_add")(inputs)
    return keras.layers.ReLU(name=f"{name}_out")(y)


def bottleneck_resnet(classes=3, main_first_in_second_block=False):
    """Stem, a projection bottleneck after a pooling layer (MindSpore's
    "FirstStep"), an identity bottleneck, and a Dense head."""
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(16, 3, padding="same", name="stem_conv")(inputs)
    x = keras.layers.BatchNormalization(name="stem_bn")(x)
    x = keras.layers.ReLU(name="stem_relu")(x)
    x = keras.layers.MaxPooling2D(1, name="stem_pool")(x)
    x = _bottleneck(x, 4, "b1", project=True)
    x = _bottleneck(
        x, 4, "b2", project=False, main_first=main_first_in_second_block
    )
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    x = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    outputs = keras.layers.Dense(classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="small_resnet")


def image_data(samples=32, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 8, 8, 3)).astype("float32")
    y = rng.integers(0, classes, samples)
    return x, y


def dense_stack(units=(16, 16, 16, 16), features=8, outputs=3):
    """Dense layers (each kernel + bias: one layer unit with the next
    layer's kernel... see `GradientFreeze`)."""
    inputs = keras.Input((features,))
    x = inputs
    for index, width in enumerate(units):
        x = keras.layers.Dense(width, activation="tanh", name=f"d{index}")(x)
    outputs = keras.layers.Dense(outputs, name="logits")(x)
    return keras.Model(inputs, outputs, name="dense_stack")


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def segmented_network(manager, small=None, seed=2):
    """x → m(0,1) → front → [×small] → m(1,2) → [×small] + main → m(2,3).

    Group 0 is the front Dense, group 1 the rest. With `small`, the
    front's gradient passes two factors `small` apart from each other:
    one global float16 scale cannot keep both products representable.
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    x = manager(inputs, 0, 1)
    front = keras.layers.Dense(4, name="front")(x)
    if small is not None:
        front = keras.layers.Rescaling(small)(front)
    front = manager(front, 1, 2)
    if small is not None:
        front = keras.layers.Rescaling(small)(front)
    main = keras.layers.Dense(4, activation="tanh", name="main")(x)
    joined = keras.layers.Add()([front, main])
    outputs = manager(keras.layers.Dense(1, name="head")(joined), 2, 3)
    model = keras.Model(inputs, outputs)
    variables = model.trainable_variables
    manager.loss_scale_groups = [
        [v for v in variables if v.path.startswith("front")],
        [v for v in variables if not v.path.startswith("front")],
    ]
    return model
