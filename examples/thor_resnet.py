"""THOR on a small ResNet, with MindSpore's ResNet-50 recipe, against SGD.

A bottleneck ResNet (Conv2D + BatchNormalization + ReLU + Add, global
average pooling, Dense head) on scikit-learn's bundled digits, upsampled to
16x16. The Keras model is converted with `keras_thor.convert_to_thor_model`
and trained with `keras_thor.optimizers.THOR` under the shape of MindSpore's
ResNet-50 THOR recipe (GPU config), scaled down to a few epochs: the
`ThorResNetLearningRate` and `ThorResNetDamping` schedules, momentum 0.9,
weight decay 5e-4, label smoothing 0.1. Keras SGD with momentum 0.9 trains
the same model (same initial weights, data, seed and learning-rate schedule)
for comparison. Prints a table.

    python examples/thor_resnet.py [--epochs 8] [--batch-size 32]
        [--frequency 10] [--seed 0]

Nothing is downloaded. Both runs take about 30 seconds on two CPU threads.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # THOR trains on TF

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import keras_thor  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(2)
tf.config.threading.set_inter_op_parallelism_threads(2)

# MindSpore's ResNet-50 THOR GPU recipe (resnet50_imagenet2012_GPU_Thor):
# 40 epochs, lr 0.05672 decaying with power 4.9687 to 0 at epoch 50 and
# halved at epoch 39; damping 0.02345 times 0.5467 every 10 epochs.
LR_INIT = 0.05672
LR_DECAY = 4.9687
LR_END_FRACTION = 50 / 40  # the rate reaches 0 at 1.25 x the trained epochs
DAMPING_INIT = 0.02345
DAMPING_DECAY_OVER_RUN = 0.5467 ** (40 / 10)  # damping at the end / start
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4
LABEL_SMOOTHING = 0.1


def digits(seed):
    """Digits as 16x16x1 images (nearest-neighbour 2x), split 80/20."""
    data = load_digits()
    images = data.images.astype("float32") / 16.0
    images = images.repeat(2, axis=1).repeat(2, axis=2)[..., None]
    images = (images - images.mean()) / images.std()
    return train_test_split(
        images,
        data.target,
        test_size=0.2,
        random_state=seed,
        stratify=data.target,
    )


def conv_bn(x, filters, kernel_size, strides=1, relu=True):
    x = keras.layers.Conv2D(
        filters, kernel_size, strides, padding="same", use_bias=False
    )(x)
    # MindSpore's BatchNorm2d momentum: moving = 0.9 * moving + 0.1 * batch.
    x = keras.layers.BatchNormalization(momentum=0.9)(x)
    return keras.layers.ReLU()(x) if relu else x


def bottleneck(x, filters, strides=1):
    """ResNet's 1x1 - 3x3 - 1x1 block; the output has 4 x `filters`."""
    shortcut = x
    if strides != 1 or x.shape[-1] != 4 * filters:
        shortcut = conv_bn(x, 4 * filters, 1, strides, relu=False)
    x = conv_bn(x, filters, 1)
    x = conv_bn(x, filters, 3, strides)
    x = conv_bn(x, 4 * filters, 1, relu=False)
    return keras.layers.ReLU()(keras.layers.Add()([x, shortcut]))


def resnet(seed):
    """A 3-block bottleneck ResNet: 16x16 -> 16x16 -> 8x8 -> 10 logits."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16, 16, 1))
    x = conv_bn(inputs, 16, 3)
    x = bottleneck(x, 8)
    x = bottleneck(x, 16, strides=2)
    x = bottleneck(x, 16)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(10)(x)
    return keras.Model(inputs, outputs, name="small_resnet")


def no_decay_for_batch_norm_and_bias(variable):
    """THOR's `decay_filter`: decay the Conv2D and Dense kernels only."""
    return "batch_normalization" not in variable.path and (
        variable.name != "bias"
    )


def learning_rate(epochs, steps_per_epoch):
    return keras_thor.schedules.ThorResNetLearningRate(
        LR_INIT,
        decay=LR_DECAY,
        total_epochs=LR_END_FRACTION * epochs,
        steps_per_epoch=steps_per_epoch,
        decay_epochs=epochs - 1,  # MindSpore halves at 39 of 40 epochs
    )


def thor(epochs, steps_per_epoch, frequency):
    # Same total damping decay as MindSpore's 40 epochs, over `epochs`.
    decay_rate = DAMPING_DECAY_OVER_RUN ** (10 / epochs)
    return keras_thor.optimizers.THOR(
        learning_rate(epochs, steps_per_epoch),
        damping=keras_thor.schedules.ThorResNetDamping(
            DAMPING_INIT, decay_rate, steps_per_epoch
        ),
        momentum=MOMENTUM,
        weight_decay=WEIGHT_DECAY,
        decay_filter=no_decay_for_batch_norm_and_bias,
        frequency=frequency,
    )


def sgd(epochs, steps_per_epoch):
    # Keras decays outside the momentum (w -= lr * wd * w); THOR and
    # MindSpore add wd * w to the update that enters it, which is worth
    # wd / (1 - momentum) once the momentum has built up.
    optimizer = keras.optimizers.SGD(
        learning_rate(epochs, steps_per_epoch),
        momentum=MOMENTUM,
        weight_decay=WEIGHT_DECAY / (1 - MOMENTUM),
    )
    # Keras matches `var_names` against `variable.name`: BN gamma and beta.
    optimizer.exclude_from_weight_decay(var_names=["gamma", "beta", "bias"])
    return optimizer


def train(name, model, optimizer, data, args):
    x_train, x_test, y_train, y_test = data
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.CategoricalCrossentropy(
            from_logits=True, label_smoothing=LABEL_SMOOTHING
        ),
        metrics=["accuracy"],
    )
    keras.utils.set_random_seed(args.seed)  # the same shuffling for both
    start = time.perf_counter()
    history = model.fit(
        x_train,
        keras.utils.to_categorical(y_train, 10),
        batch_size=args.batch_size,
        epochs=args.epochs,
        # MindSpore's THOR refuses evaluation during training; this works.
        validation_data=(x_test, keras.utils.to_categorical(y_test, 10)),
        verbose=0,
    )
    seconds = time.perf_counter() - start
    return {
        "name": name,
        "troubles": getattr(optimizer, "curvature_troubles", None),
        "loss": history.history["loss"][-1],
        "accuracy": history.history["val_accuracy"],
        "seconds": seconds,
        "epochs": args.epochs,
    }


def print_table(results, args, steps_per_epoch):
    print(
        f"digits 16x16 bottleneck ResNet, batch {args.batch_size}, "
        f"{steps_per_epoch} steps/epoch, THOR frequency {args.frequency}, "
        f"seed {args.seed}"
    )
    header = (
        f"{'optimizer':<24} {'train loss':>10} {'test acc':>9} "
        f"{'seconds':>8} {'epochs':>7}  test acc per epoch"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        curve = " ".join(f"{a:.2f}" for a in r["accuracy"])
        print(
            f"{r['name']:<24} {r['loss']:>10.4f} {r['accuracy'][-1]:>9.4f} "
            f"{r['seconds']:>8.1f} {r['epochs']:>7}  {curve}"
        )
    for r in results:
        if r["troubles"] is not None:
            print(
                f"{r['name']}: {r['troubles']} layer refreshes fell back to "
                "a more damped inverse or kept the previous one"
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--frequency",
        type=int,
        default=10,
        help="THOR's curvature refresh interval in steps (MindSpore: 834 "
        "of 5004 steps an epoch, about 6 refreshes an epoch)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if keras.backend.backend() != "tensorflow":
        parser.error("THOR trains on the TensorFlow backend only")
    data = digits(args.seed)
    steps_per_epoch = -(-len(data[0]) // args.batch_size)
    base = resnet(args.seed)
    thor_model = keras_thor.convert_to_thor_model(base)  # base, in place
    sgd_model = keras.models.clone_model(base)
    sgd_model.set_weights(base.get_weights())
    results = [
        train(
            "THOR",
            thor_model,
            thor(args.epochs, steps_per_epoch, args.frequency),
            data,
            args,
        ),
        train(
            "keras SGD momentum 0.9",
            sgd_model,
            sgd(args.epochs, steps_per_epoch),
            data,
            args,
        ),
    ]
    print_table(results, args, steps_per_epoch)


if __name__ == "__main__":
    main()
