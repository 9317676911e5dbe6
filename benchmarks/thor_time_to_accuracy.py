"""Time to accuracy: THOR against Keras SGD (momentum 0.9) and Adam.

Benchmark 1 of docs/benchmarks.md. Two models on scikit-learn's bundled
digits (nothing is downloaded), the same data split, batch, seed and initial
weights for every optimizer: (a) an MLP on the 64 pixels, (b) a small
ResNet-style CNN on the images upsampled to 16x16. Each optimizer runs over
a small learning-rate grid, for every seed (the seed also picks the data
split); a run stops when its test accuracy (measured after every epoch,
outside the timed training) reaches the target. The best grid point of each
optimizer reaches the target on every seed with the fewest mean epochs
(then the least mean time). Prints a table and the ratios THOR / best
first-order baseline, and writes a plot of training loss against training
seconds (first seed).

    python benchmarks/thor_time_to_accuracy.py [--models mlp cnn]
        [--seeds 0 1 2] [--plot results/thor_time_to_accuracy.png]
"""

import argparse
import os
import pathlib
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import keras_thor  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def digits(seed, images):
    """Digits scaled to [0, 1] (80/20, stratified); images upsampled 2x."""
    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    if images:
        x = x.reshape(-1, 8, 8, 1).repeat(2, axis=1).repeat(2, axis=2)
    return train_test_split(
        x, data.target, test_size=0.2, random_state=seed, stratify=data.target
    )


def mlp():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, "relu", name="hidden1"),
            keras.layers.Dense(128, "relu", name="hidden2"),
            keras.layers.Dense(10, name="logits"),
        ],
        name="mlp",
    )


def _residual(x, filters, strides, name):
    shortcut = x
    y = keras.layers.Conv2D(
        filters, 3, strides, "same", use_bias=False, name=f"{name}_conv1"
    )(x)
    y = keras.layers.BatchNormalization(momentum=0.9, name=f"{name}_bn1")(y)
    y = keras.layers.ReLU()(y)
    y = keras.layers.Conv2D(
        filters, 3, 1, "same", use_bias=False, name=f"{name}_conv2"
    )(y)
    y = keras.layers.BatchNormalization(momentum=0.9, name=f"{name}_bn2")(y)
    if strides != 1 or shortcut.shape[-1] != filters:
        shortcut = keras.layers.Conv2D(
            filters, 1, strides, use_bias=False, name=f"{name}_proj"
        )(shortcut)
        shortcut = keras.layers.BatchNormalization(
            momentum=0.9, name=f"{name}_proj_bn"
        )(shortcut)
    return keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))


def resnet():
    inputs = keras.Input((16, 16, 1))
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False, name="stem")(
        inputs
    )
    x = keras.layers.BatchNormalization(momentum=0.9, name="stem_bn")(x)
    x = keras.layers.ReLU()(x)
    x = _residual(x, 16, 1, "block1")
    x = _residual(x, 32, 2, "block2")
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(10, name="logits")(x)
    return keras.Model(inputs, outputs, name="resnet")


# THOR's damping and frequency per model: picked on seed 0 by
# benchmarks/thor_select_damping.py (docs/benchmarks.md).
SETUPS = {
    "mlp": dict(
        build=mlp,
        images=False,
        batch=256,
        target=0.96,
        max_epochs=30,
        grids={
            "SGD momentum 0.9": [0.1, 0.3, 1.0],
            "Adam": [3e-3, 1e-2, 3e-2],
            "THOR": [0.1, 0.3, 1.0],
        },
        damping=0.03,
        frequency=2,
    ),
    "cnn": dict(
        build=resnet,
        images=True,
        batch=64,
        target=0.98,
        max_epochs=15,
        grids={
            "SGD momentum 0.9": [0.03, 0.1, 0.3],
            "Adam": [1e-3, 3e-3, 1e-2],
            "THOR": [0.03, 0.1, 0.3],
        },
        damping=0.01,
        frequency=5,
    ),
}


def optimizer(name, learning_rate, setup):
    if name == "THOR":
        return keras_thor.optimizers.THOR(
            learning_rate,
            damping=setup["damping"],
            momentum=0.9,
            frequency=setup["frequency"],
        )
    if name == "Adam":
        return keras.optimizers.Adam(learning_rate)
    return keras.optimizers.SGD(learning_rate, momentum=0.9)


class TimeToAccuracy(keras.callbacks.Callback):
    """Training seconds, loss and test accuracy per epoch; stops at target.

    The clock runs from the start of each epoch to its end (tracing and
    compiling included); the test accuracy is measured after the clock
    stops.
    """

    def __init__(self, x_test, y_test, target):
        super().__init__()
        self.x_test, self.y_test, self.target = x_test, y_test, target
        self.seconds, self.losses, self.accuracies = [], [], []
        self._elapsed = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self._elapsed += time.perf_counter() - self._start
        self.seconds.append(self._elapsed)
        self.losses.append(logs["loss"])
        logits = self.model(self.x_test, training=False)
        predicted = np.argmax(keras.ops.convert_to_numpy(logits), axis=1)
        self.accuracies.append(float(np.mean(predicted == self.y_test)))
        if self.accuracies[-1] >= self.target:
            self.model.stop_training = True

    def reached(self):
        """(epochs, seconds) to the target, or None."""
        for epoch, accuracy in enumerate(self.accuracies):
            if accuracy >= self.target:
                return epoch + 1, self.seconds[epoch]
        return None


def _state(model):
    return model.get_weights(), [
        np.array(keras.ops.convert_to_numpy(v))
        for v in model.optimizer.variables
    ]


def _restore(model, state):
    weights, optimizer_values = state
    model.set_weights(weights)
    for variable, value in zip(model.optimizer.variables, optimizer_values):
        variable.assign(value)


def run(setup, name, learning_rate, seed, data):
    """One grid point: two warm-up epochs, a reset, then the timed run.

    The warm-up traces (and compiles) the training functions, for full and
    partial batches and, for THOR, for refresh and plain steps; the weights
    and the optimizer state are then put back, so every optimizer starts
    the timed run from the same point with its functions already traced
    (and the same shuffles: the warm-up draws the same random numbers).
    Returns the tracker and the warm-up seconds.
    """
    x_train, x_test, y_train, y_test = data
    keras.utils.set_random_seed(seed)
    model = setup["build"]()
    if name == "THOR":
        model = keras_thor.convert_to_thor_model(model)
    model.compile(
        optimizer=optimizer(name, learning_rate, setup),
        loss=LOSS,
    )
    model.optimizer.build(model.trainable_variables)
    initial = _state(model)
    # Seeded after the model is built (THOR's conversion draws initial
    # values it then overwrites), before anything is traced: the shuffles
    # are the same for every optimizer, and no traced function is
    # invalidated by re-seeding later.
    keras.utils.set_random_seed(seed)
    start = time.perf_counter()
    model.fit(x_train, y_train, batch_size=setup["batch"], epochs=2, verbose=0)
    warmup = time.perf_counter() - start
    _restore(model, initial)
    tracker = TimeToAccuracy(x_test, y_test, setup["target"])
    model.fit(
        x_train,
        y_train,
        batch_size=setup["batch"],
        epochs=setup["max_epochs"],
        callbacks=[tracker],
        verbose=0,
    )
    tracker.warmup = warmup
    return tracker


def _mean_reached(trackers):
    """(mean epochs, mean seconds) over seeds, or None if one fell short."""
    reached = [tracker.reached() for tracker in trackers]
    if not all(reached):
        return None
    return tuple(float(np.mean(values)) for values in zip(*reached))


def best(runs):
    """The grid point with the fewest mean epochs to target (then time).

    Only grid points that reach the target on every seed qualify.
    """
    reached = [
        (_mean_reached(trackers), lr)
        for lr, trackers in runs.items()
        if _mean_reached(trackers)
    ]
    return min(reached, key=lambda item: item[0]) if reached else None


def benchmark(model_name, seeds):
    setup = SETUPS[model_name]
    results = {
        name: {lr: [] for lr in grid} for name, grid in setup["grids"].items()
    }
    for seed in seeds:
        data = digits(seed, setup["images"])
        for name, grid in setup["grids"].items():
            for lr in grid:
                results[name][lr].append(run(setup, name, lr, seed, data))
    return setup, results


def report(model_name, setup, results, seeds):
    print(
        f"\n{model_name}: target test accuracy {setup['target']}, batch "
        f"{setup['batch']}, at most {setup['max_epochs']} epochs, seeds "
        f"{', '.join(map(str, seeds))}"
    )
    print(
        f"{'optimizer':<18} {'lr':>7} {'epochs per seed':>16} {'mean':>5} "
        f"{'mean s':>7} {'warm-up s':>9} best"
    )
    winners = {}
    for name, runs in results.items():
        winner = best(runs)
        winners[name] = winner
        for lr, trackers in runs.items():
            epochs = "/".join(
                str(t.reached()[0]) if t.reached() else "-" for t in trackers
            )
            mean = _mean_reached(trackers) or (float("nan"),) * 2
            warmup = np.mean([t.warmup for t in trackers])
            mark = "*" if winner and winner[1] == lr else ""
            print(
                f"{name:<18} {lr:>7g} {epochs:>16} {mean[0]:>5.2f} "
                f"{mean[1]:>7.2f} {warmup:>9.2f} {mark}"
            )
    baselines = [w for n, w in winners.items() if n != "THOR" and w]
    thor = winners["THOR"]
    if thor and baselines:
        epochs = thor[0][0] / min(w[0][0] for w in baselines)
        seconds = thor[0][1] / min(w[0][1] for w in baselines)
        print(
            f"THOR / best baseline (means over seeds): epochs {epochs:.2f}x "
            f"(target <= 0.5), wall seconds {seconds:.2f}x (target <= 0.8)"
        )
    return winners


def plot(all_results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(
        1, len(all_results), figsize=(6 * len(all_results), 4), squeeze=False
    )
    for axis, (model_name, (setup, results, winners)) in zip(
        axes[0], all_results.items()
    ):
        for name, winner in winners.items():
            if not winner:
                continue
            _, lr = winner
            tracker = results[name][lr][0]
            axis.plot(
                tracker.seconds,
                tracker.losses,
                marker="o",
                label=f"{name} {lr:g}",
            )
        axis.set_yscale("log")
        axis.set_xlabel("training seconds")
        axis.set_ylabel("training loss")
        axis.set_title(
            f"{model_name}: best of each (first seed), to {setup['target']}"
        )
        axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    print(f"\nwrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--plot", type=pathlib.Path, default="results/thor_time_to_accuracy.png"
    )
    args = parser.parse_args()
    print(
        f"keras {keras.__version__}, backend {keras.backend.backend()}, "
        f"{os.cpu_count()} CPUs"
    )
    all_results = {}
    for model_name in args.models:
        setup, results = benchmark(model_name, args.seeds)
        winners = report(model_name, setup, results, args.seeds)
        all_results[model_name] = (setup, results, winners)
    plot(all_results, args.plot)


if __name__ == "__main__":
    main()
