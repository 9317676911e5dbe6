"""Time to accuracy: THOR against Keras SGD (momentum 0.9) and Adam.

Benchmark 1 of docs/benchmarks.md. Two models on scikit-learn's bundled
digits (nothing is downloaded), the same data split, batch, seed and initial
weights for every optimizer (SGD both with heavy-ball and with Nesterov
momentum): (a) an MLP on the 64 pixels, (b) a small ResNet-style CNN on
the images upsampled to 16x16. Each optimizer runs over the same kind of
grid, for every seed (the seed also picks the data split): its own learning
rates x the model's decay horizons (a constant rate, or a cosine decay to a
fifth over 3 or 6 epochs). A run stops when its test
accuracy reaches the target; the accuracy is measured 8 times an epoch,
outside the timed training, with BatchNormalization's statistics
recomputed over the training set (`test_accuracy`). The best grid point of
each optimizer reaches the target on every seed with the fewest mean epochs
(then the least mean time). Prints a table and the ratios THOR / best
first-order baseline, and writes a plot of training loss against training
seconds (first seed).

    python benchmarks/thor_time_to_accuracy.py [--models mlp cnn]
        [--seeds 0 1 2] [--plot results/thor_time_to_accuracy.png]
"""

import argparse
import itertools
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


# Test accuracy checks per epoch; the cosine decay's floor (a fraction of
# the initial rate).
EVALUATIONS = 8
DECAY_TO = 0.2
# The baseline that is Keras's SGD with Nesterov momentum.
SGD_NESTEROV = "SGD Nesterov 0.9"

# THOR's damping, frequency and momentum kind per model: picked on the
# held-out seeds 3 and 4 by benchmarks/thor_select_damping.py
# (docs/benchmarks.md).
SETUPS = {
    "mlp": dict(
        build=mlp,
        images=False,
        batch=256,
        target=0.96,
        max_epochs=30,
        grids={
            "SGD momentum 0.9": [0.1, 0.3, 1.0],
            SGD_NESTEROV: [0.1, 0.3, 1.0],
            "Adam": [1e-2, 3e-2, 1e-1],
            "THOR": [0.03, 0.1, 0.3],
        },
        decay_epochs=(None,),
        damping=0.01,
        frequency=2,
        use_nesterov=True,
    ),
    "cnn": dict(
        build=resnet,
        images=True,
        batch=64,
        target=0.98,
        max_epochs=15,
        grids={
            "SGD momentum 0.9": [0.1, 0.3, 1.0],
            SGD_NESTEROV: [0.1, 0.3, 1.0],
            "Adam": [3e-3, 1e-2, 3e-2],
            "THOR": [0.01, 0.03, 0.1],
        },
        decay_epochs=(None, 3, 6),
        damping=0.03,
        frequency=2,
        use_nesterov=True,
    ),
}


def grid_points(setup, name):
    """`name`'s grid: (learning rate, decay epochs) pairs."""
    return list(itertools.product(setup["grids"][name], setup["decay_epochs"]))


def learning_rate_schedule(learning_rate, decay_epochs, steps_per_epoch):
    """A constant rate, or a cosine decay to a fifth over `decay_epochs`."""
    if decay_epochs is None:
        return learning_rate
    return keras.optimizers.schedules.CosineDecay(
        learning_rate, decay_epochs * steps_per_epoch, alpha=DECAY_TO
    )


def optimizer(name, learning_rate, setup):
    if name == "THOR":
        return keras_thor.optimizers.THOR(
            learning_rate,
            damping=setup["damping"],
            momentum=0.9,
            use_nesterov=setup["use_nesterov"],
            frequency=setup["frequency"],
            batch_size=setup["batch"],
        )
    if name == "Adam":
        return keras.optimizers.Adam(learning_rate)
    return keras.optimizers.SGD(
        learning_rate, momentum=0.9, nesterov=name == SGD_NESTEROV
    )


def _batch_normalizations(layer):
    """The BatchNormalization layers in `layer`, nested models included."""
    if isinstance(layer, keras.layers.BatchNormalization):
        yield layer
    for sublayer in getattr(layer, "layers", ()):
        yield from _batch_normalizations(sublayer)


def test_accuracy(model, x_train, x_test, y_test):
    """Test accuracy with BatchNormalization's population statistics.

    The moving averages lag behind weights that change fast (at the start
    of training a ResNet's inference-mode accuracy stays at chance for an
    epoch or more, for every optimizer), so before the test pass each
    BatchNormalization layer takes the mean and variance of its inputs over
    the whole training set at the current weights ("precise BN"); the
    moving averages are put back afterwards, so training is unchanged.
    """
    norms = list(_batch_normalizations(model))
    moving = [v for norm in norms for v in norm.non_trainable_variables]
    saved = [keras.ops.convert_to_numpy(v) for v in moving]
    momenta = [norm.momentum for norm in norms]
    for norm in norms:
        norm.momentum = 0.0
    if norms:
        model(x_train, training=True)
    logits = model(x_test, training=False)
    for norm, momentum in zip(norms, momenta):
        norm.momentum = momentum
    for variable, value in zip(moving, saved):
        variable.assign(value)
    predicted = np.argmax(keras.ops.convert_to_numpy(logits), axis=1)
    return float(np.mean(predicted == y_test))


class TimeToAccuracy(keras.callbacks.Callback):
    """Training seconds, loss and test accuracy; stops at the target.

    The test accuracy is measured `evaluations` times per epoch, after
    evenly spaced steps (the last step of each epoch included), with the
    clock stopped (`test_accuracy`); the clock runs otherwise from the start
    of each epoch to its end (tracing and compiling included).
    """

    def __init__(self, data, target, steps_per_epoch, evaluations):
        super().__init__()
        self.data, self.target = data, target
        self.steps_per_epoch = steps_per_epoch
        self.evaluate_after = {
            int(np.ceil(steps_per_epoch * (i + 1) / evaluations))
            for i in range(evaluations)
        }
        self.epochs, self.seconds, self.losses, self.accuracies = [], [], [], []
        self._elapsed = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 not in self.evaluate_after:
            return
        self._elapsed += time.perf_counter() - self._start
        self.epochs.append(self._epoch + (batch + 1) / self.steps_per_epoch)
        self.seconds.append(self._elapsed)
        self.losses.append(float(logs["loss"]))
        x_train, x_test, _, y_test = self.data
        self.accuracies.append(
            test_accuracy(self.model, x_train, x_test, y_test)
        )
        if self.accuracies[-1] >= self.target:
            self.model.stop_training = True
        self._start = time.perf_counter()

    def reached(self):
        """(epochs, seconds) to the target, or None."""
        for epochs, seconds, accuracy in zip(
            self.epochs, self.seconds, self.accuracies
        ):
            if accuracy >= self.target:
                return epochs, seconds
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


def run(setup, name, point, seed, data):
    """One grid point (learning rate, decay epochs): two warm-up epochs, a
    reset, then the timed run.

    The warm-up traces (and compiles) the training functions, for full and
    partial batches and, for THOR, for refresh and plain steps; the weights
    and the optimizer state are then put back, so every optimizer starts
    the timed run from the same point with its functions already traced
    (and the same shuffles: the warm-up draws the same random numbers).
    Returns the tracker and the warm-up seconds.
    """
    x_train, _, y_train, _ = data
    steps_per_epoch = int(np.ceil(len(x_train) / setup["batch"]))
    learning_rate = learning_rate_schedule(*point, steps_per_epoch)
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
    tracker = TimeToAccuracy(
        data, setup["target"], steps_per_epoch, EVALUATIONS
    )
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


def mean_reached(trackers):
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
        (mean_reached(trackers), point)
        for point, trackers in runs.items()
        if mean_reached(trackers)
    ]
    return min(reached, key=lambda item: item[0]) if reached else None


def benchmark(model_name, seeds):
    setup = SETUPS[model_name]
    results = {
        name: {point: [] for point in grid_points(setup, name)}
        for name in setup["grids"]
    }
    for seed in seeds:
        data = digits(seed, setup["images"])
        for name, runs in results.items():
            for point, trackers in runs.items():
                trackers.append(run(setup, name, point, seed, data))
    return setup, results


def decay_name(decay_epochs):
    return "constant" if decay_epochs is None else f"cos {decay_epochs}"


def report(model_name, setup, results, seeds):
    print(
        f"\n{model_name}: target test accuracy {setup['target']}, batch "
        f"{setup['batch']}, at most {setup['max_epochs']} epochs, seeds "
        f"{', '.join(map(str, seeds))}"
    )
    print(
        f"{'optimizer':<18} {'lr':>7} {'decay':>8} {'epochs per seed':>18} "
        f"{'mean':>5} {'mean s':>7} {'warm-up s':>9} best"
    )
    winners = {}
    for name, runs in results.items():
        winner = best(runs)
        winners[name] = winner
        for point, trackers in runs.items():
            epochs = "/".join(
                f"{t.reached()[0]:.3g}" if t.reached() else "-"
                for t in trackers
            )
            mean = mean_reached(trackers) or (float("nan"),) * 2
            warmup = np.mean([t.warmup for t in trackers])
            mark = "*" if winner and winner[1] == point else ""
            print(
                f"{name:<18} {point[0]:>7g} {decay_name(point[1]):>8} "
                f"{epochs:>18} {mean[0]:>5.2f} {mean[1]:>7.2f} "
                f"{warmup:>9.2f} {mark}"
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
            _, point = winner
            tracker = results[name][point][0]
            axis.plot(
                tracker.seconds,
                tracker.losses,
                marker="o",
                label=f"{name} {point[0]:g}, {decay_name(point[1])}",
            )
        axis.set_yscale("log")
        axis.set_xlabel("training seconds")
        axis.set_ylabel("training loss (mean so far this epoch)")
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
