"""AutoBoost O1 on Keras's ResNet-50, MindSpore's model-zoo way.

MindSpore's ResNet-50 boost recipe trains with `boost_level="O1"` and
`boost_config_dict={"grad_freeze": {"total_steps": epochs * steps}}`. Here
the same configuration goes through `keras_thor.boost.AutoBoost` onto
`keras.applications.ResNet50(weights=None)` at 32x32 inputs (ten classes of
synthetic images, generated here; nothing is downloaded). Prints what O1
changed (batch normalizations bypassed, the FullNorm head, centralized
kernels, the freezing groups) and trains O0 and O1 for the same steps from
the same weights, printing each one's loss and images per second.

    python examples/boost_resnet50.py [--steps 30] [--batch-size 32]

About a minute on two CPU threads.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # boost trains on TF

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_thor  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(2)
tf.config.threading.set_inter_op_parallelism_threads(2)


def images(samples, seed):
    """Ten classes of smooth random patterns plus noise, 32x32x3."""
    rng = np.random.RandomState(seed)
    templates = rng.normal(size=(10, 4, 4, 3)).repeat(8, 1).repeat(8, 2)
    labels = rng.randint(0, 10, samples)
    x = templates[labels] + rng.normal(scale=0.5, size=(samples, 32, 32, 3))
    return x.astype("float32"), labels


class Timer(keras.callbacks.Callback):
    """Seconds of every step after the first `skip` (tracing)."""

    def __init__(self, skip):
        super().__init__()
        self.skip, self.times = skip, []

    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if batch >= self.skip:
            self.times.append(time.perf_counter() - self.start)


def train(level, weights, x, y, args):
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(
        weights=None, input_shape=(32, 32, 3), classes=10
    )
    model.set_weights(weights)
    boost = keras_thor.boost.AutoBoost(
        level, {"grad_freeze": {"total_steps": args.steps}}
    )
    model, optimizer, callbacks = boost.network_auto_process_train(
        model, keras.optimizers.SGD(0.02, momentum=0.9)
    )
    if level == "O1":
        describe(model, optimizer)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    # O1 traces one function per freezing group it meets: skip more steps.
    timer = Timer(skip=10 if level == "O1" else 2)
    history = model.fit(
        x,
        y,
        batch_size=args.batch_size,
        epochs=1,
        steps_per_epoch=args.steps,
        verbose=0,
        callbacks=[timer, *callbacks],
    )
    return history.history["loss"][-1], args.batch_size / np.median(timer.times)


def describe(model, optimizer):
    # LessBN changes the model in place: a bypassed BatchNormalization is
    # frozen, and the head `Dense` holds the FullNorm multiplier.
    running = sum(
        isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
        for layer in model.layers
    )
    head = model.get_layer("predictions")
    freeze = optimizer.grad_freeze
    groups = freeze.split_parameters_groups(model)
    print(f"O1: {running} of ResNet-50's 53 BatchNormalization layers run")
    full_norm = hasattr(head, "full_norm_multiplier")
    print(f"    head: {'FullNorm' if full_norm else type(head).__name__}")
    print(
        f"    {len(optimizer.centralized_variables)} kernels with centralized "
        "gradients"
    )
    print(
        f"    {len(groups)} freezing groups of "
        f"{[len(g) for g in groups]} variables; first steps' groups: "
        f"{freeze.generate_freeze_index_sequence()[:16].tolist()}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    x, y = images(args.steps * args.batch_size, seed=0)
    keras.utils.set_random_seed(0)
    weights = keras.applications.ResNet50(
        weights=None, input_shape=(32, 32, 3), classes=10
    ).get_weights()
    results = {
        level: train(level, weights, x, y, args) for level in ("O0", "O1")
    }
    print(f"\n{'level':6s} {'last loss':>10s} {'img/s':>8s} {'× O0':>6s}")
    for level, (loss, speed) in results.items():
        ratio = speed / results["O0"][1]
        print(f"{level:6s} {loss:10.4f} {speed:8.1f} {ratio:6.2f}")


if __name__ == "__main__":
    main()
