"""Boost throughput: AutoBoost O0 against O1 and each algorithm alone.

Benchmark of docs/benchmarks.md for `keras_thor.boost`. A ResNet-style CNN
with bottleneck blocks (the blocks LessBN prunes) on synthetic 32x32 images
(ten classes of shifted smooth patterns plus noise, generated here, nothing
downloaded); the same data, batch, seed and initial weights for every
configuration, SGD with momentum 0.9 and weight decay 5e-4 (BatchNormalization
momentum 0.9). Each configuration trains the same
epochs; throughput counts the examples of every step after the first of
its traced variant (tracing excluded) over those steps' time, and the test
accuracy is measured after the last epoch. Prints a table with ratios to
O0 (plain Keras) measured in the same run.

    python benchmarks/boost_throughput.py [--epochs 5] [--seeds 0 1]
        [--configs O0 O1 less_bn ...]
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_thor  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CLASSES = 10
BATCH = 64

CONFIGS = {
    "O0": ("O0", {}),
    "O1": ("O1", {}),
    "less_bn": (
        "O0",
        {
            "boost": {"mode": "manual", "less_bn": True},
            "less_bn": {"fn_flag": False, "gc_flag": False},
        },
    ),
    "less_bn+fn": (
        "O0",
        {
            "boost": {"mode": "manual", "less_bn": True},
            "less_bn": {"gc_flag": False},
        },
    ),
    "less_bn+gc": (
        "O0",
        {
            "boost": {"mode": "manual", "less_bn": True},
            "less_bn": {"fn_flag": False},
        },
    ),
    "less_bn+fn+gc": ("O0", {"boost": {"mode": "manual", "less_bn": True}}),
    "grad_freeze": ("O0", {"boost": {"mode": "manual", "grad_freeze": True}}),
    # Not an AutoBoost switch of its own: OptimizerProcess (see `run`).
    "grad_centralization": (None, {}),
    "grad_accumulation(2)": (
        "O0",
        {
            "boost": {"mode": "manual", "grad_accumulation": True},
            "grad_accumulation": {"grad_accumulation_step": 2},
        },
    ),
}


def synthetic_images(samples, seed):
    """Ten classes of smooth random patterns, randomly shifted, plus noise."""
    rng = np.random.RandomState(1234)
    coarse = rng.normal(size=(CLASSES, 4, 4, 3))
    templates = coarse.repeat(8, axis=1).repeat(8, axis=2)
    templates = (templates + rng.normal(scale=0.5, size=templates.shape)) / 2
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, CLASSES, samples)
    shifts = rng.randint(-6, 7, size=(samples, 2))
    images = np.stack(
        [
            np.roll(templates[label], tuple(shift), axis=(0, 1))
            for label, shift in zip(labels, shifts)
        ]
    )
    images += rng.normal(scale=1.0, size=images.shape)
    return images.astype("float32"), labels


def _bottleneck(x, width, strides, name):
    shortcut = x
    if strides != 1 or x.shape[-1] != 4 * width:
        shortcut = keras.layers.Conv2D(
            4 * width, 1, strides=strides, name=f"{name}_0_conv"
        )(x)
        shortcut = keras.layers.BatchNormalization(
            momentum=0.9, name=f"{name}_0_bn"
        )(shortcut)
    y = keras.layers.Conv2D(width, 1, strides=strides, name=f"{name}_1_conv")(x)
    y = keras.layers.BatchNormalization(momentum=0.9, name=f"{name}_1_bn")(y)
    y = keras.layers.Activation("relu", name=f"{name}_1_relu")(y)
    y = keras.layers.Conv2D(width, 3, padding="same", name=f"{name}_2_conv")(y)
    y = keras.layers.BatchNormalization(momentum=0.9, name=f"{name}_2_bn")(y)
    y = keras.layers.Activation("relu", name=f"{name}_2_relu")(y)
    y = keras.layers.Conv2D(4 * width, 1, name=f"{name}_3_conv")(y)
    y = keras.layers.BatchNormalization(momentum=0.9, name=f"{name}_3_bn")(y)
    y = keras.layers.Add(name=f"{name}_add")([shortcut, y])
    return keras.layers.Activation("relu", name=f"{name}_out")(y)


def bottleneck_resnet():
    """A small ResNet-50-style network: stem, 3 stages of 2 bottlenecks."""
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(32, 3, padding="same", name="stem_conv")(inputs)
    x = keras.layers.BatchNormalization(momentum=0.9, name="stem_bn")(x)
    x = keras.layers.Activation("relu", name="stem_relu")(x)
    for stage, (width, strides) in enumerate([(16, 1), (32, 2), (64, 2)]):
        for block in range(2):
            x = _bottleneck(
                x, width, strides if block == 0 else 1, f"s{stage}b{block}"
            )
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = keras.layers.Dense(CLASSES, name="logits")(x)
    return keras.Model(inputs, outputs, name="bottleneck_resnet")


class StepTimes(keras.callbacks.Callback):
    """Wall time of every training step."""

    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def _variants(optimizer, steps):
    """The traced variant each step runs (plain Keras: one)."""
    if not isinstance(optimizer, keras_thor.boost.BoostOptimizer):
        return [0] * steps
    freeze = optimizer.grad_freeze
    return [
        (
            0 if freeze is None else freeze.group_at(step),
            optimizer.applies_at(step),
        )
        for step in range(steps)
    ]


def run(config, seed, data, epochs, initial_weights):
    (x_train, y_train), (x_test, y_test) = data
    level, boost_config = CONFIGS[config]
    keras.utils.set_random_seed(seed)
    model = bottleneck_resnet()
    model.set_weights(initial_weights)
    steps = epochs * (len(x_train) // BATCH)
    if "grad_freeze" in boost_config.get("boost", {}) or level in ("O1", "O2"):
        boost_config = {**boost_config, "grad_freeze": {"total_steps": steps}}
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9, weight_decay=5e-4)
    if level is None:
        process = keras_thor.boost.OptimizerProcess(optimizer)
        process.add_grad_centralization(model)
        optimizer, callbacks = process.generate_new_optimizer(), []
    else:
        boost = keras_thor.boost.AutoBoost(level, boost_config)
        model, optimizer, callbacks = boost.network_auto_process_train(
            model, optimizer
        )
    model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"])
    times = StepTimes()
    model.fit(
        x_train[: steps // epochs * BATCH],
        y_train[: steps // epochs * BATCH],
        batch_size=BATCH,
        epochs=epochs,
        verbose=0,
        shuffle=True,
        callbacks=[times, *callbacks],
    )
    seen = set()
    timed = []
    for variant, seconds in zip(_variants(optimizer, steps), times.times):
        if variant in seen:
            timed.append(seconds)
        seen.add(variant)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    return {
        "throughput": BATCH * len(timed) / sum(timed),
        "accuracy": accuracy,
        "seconds": sum(times.times),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--samples", type=int, default=3200)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    args = parser.parse_args()
    print(
        f"keras {keras.__version__}, backend {keras.backend.backend()}, "
        f"{os.cpu_count()} CPUs; {args.samples} training images, batch "
        f"{BATCH}, {args.epochs} epochs, seeds {args.seeds}"
    )
    results = {config: [] for config in args.configs}
    for seed in args.seeds:
        data = (
            synthetic_images(args.samples, seed),
            synthetic_images(2000, seed + 100),
        )
        keras.utils.set_random_seed(seed)
        initial_weights = bottleneck_resnet().get_weights()
        for config in args.configs:
            result = run(config, seed, data, args.epochs, initial_weights)
            results[config].append(result)
            print(
                f"  seed {seed} {config:22s} {result['throughput']:8.1f} "
                f"img/s  accuracy {result['accuracy']:.4f}",
                flush=True,
            )
    base = results.get("O0")
    print(
        f"\n{'config':22s} {'img/s':>8s} {'× O0':>6s} {'accuracy':>9s} "
        f"{'Δ points':>9s}"
    )
    for config, runs in results.items():
        throughput = np.mean([r["throughput"] for r in runs])
        accuracy = np.mean([r["accuracy"] for r in runs])
        ratio = delta = float("nan")
        if base:
            ratio = throughput / np.mean([r["throughput"] for r in base])
            delta = 100 * (accuracy - np.mean([r["accuracy"] for r in base]))
        print(
            f"{config:22s} {throughput:8.1f} {ratio:6.2f} {accuracy:9.4f} "
            f"{delta:+9.2f}"
        )


if __name__ == "__main__":
    main()
