"""ASGD and SAG against Keras SGD on scikit-learn's bundled digits.

The main job of keras_thor until THOR lands: one MLP, one data split, one
seed, trained with each optimizer for the same number of epochs. Prints a
table (test accuracy, and for ASGD the accuracy of its averaged weights)
and writes a plot of training loss and test accuracy per epoch.

    python examples/digits_comparison.py [--epochs 30] [--plot PATH]

The digits data (1,797 8x8 images) ships with scikit-learn: nothing is
downloaded.
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

BATCH = 64
SEED = 0


def digits():
    """Standardized digits, split 80/20 with a fixed seed."""
    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1e-6)
    return train_test_split(
        x, data.target, test_size=0.2, random_state=SEED, stratify=data.target
    )


def mlp():
    init = keras.initializers.GlorotUniform(seed=SEED)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, "relu", kernel_initializer=init),
            keras.layers.Dense(10, kernel_initializer=init),
        ]
    )


def optimizers(steps_per_epoch, epochs):
    return {
        "keras SGD": keras.optimizers.SGD(learning_rate=0.05),
        "keras SGD momentum 0.9": keras.optimizers.SGD(
            learning_rate=0.01, momentum=0.9
        ),
        "ASGD": keras_thor.optimizers.ASGD(
            # Average the second half of training (Polyak-Ruppert).
            learning_rate=0.05,
            t0=(epochs // 2) * steps_per_epoch,
        ),
        "SAG": keras_thor.optimizers.SAG(
            learning_rate=0.05, batch_num=steps_per_epoch
        ),
    }


class TestAccuracy(keras.callbacks.Callback):
    """Test accuracy after each epoch (for ASGD, of the averaged weights)."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y
        self.accuracy = []

    def on_epoch_end(self, epoch, logs=None):
        self.accuracy.append(accuracy(self.model, self.x, self.y))


def accuracy(model, x, y):
    logits = model.predict(x, batch_size=512, verbose=0)
    return float(np.mean(np.argmax(logits, axis=1) == y))


def train(name, optimizer, data, epochs):
    x_train, x_test, y_train, y_test = data
    keras.utils.set_random_seed(SEED)
    model = mlp()
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    tracker = TestAccuracy(x_test, y_test)
    callbacks = [tracker]
    if isinstance(optimizer, keras_thor.optimizers.ASGD):
        callbacks.insert(0, keras_thor.callbacks.SwapAveragedWeights(True))
    start = time.perf_counter()
    history = model.fit(
        x_train,
        y_train,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,  # SAG's slots follow the batches in a fixed order
        callbacks=callbacks,
        verbose=0,
    )
    seconds = time.perf_counter() - start
    result = {
        "name": name,
        "loss": history.history["loss"],
        "test_accuracy": tracker.accuracy,
        "final_accuracy": accuracy(model, x_test, y_test),
        "seconds": seconds,
    }
    if isinstance(optimizer, keras_thor.optimizers.ASGD):
        with optimizer.use_averaged_weights():
            result["averaged_accuracy"] = accuracy(model, x_test, y_test)
    return result


def print_table(results, epochs):
    print(f"digits MLP 64-128-10, batch {BATCH}, {epochs} epochs, seed {SEED}")
    header = (
        f"{'optimizer':<24} {'train loss':>10} {'test acc':>9} "
        f"{'averaged':>9} {'seconds':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        averaged = r.get("averaged_accuracy")
        averaged = f"{averaged:>9.4f}" if averaged is not None else f"{'-':>9}"
        print(
            f"{r['name']:<24} {r['loss'][-1]:>10.4f} "
            f"{r['final_accuracy']:>9.4f} {averaged} {r['seconds']:>8.1f}"
        )


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        epochs = np.arange(1, len(r["loss"]) + 1)
        loss_axis.plot(epochs, r["loss"], label=r["name"])
        label = r["name"] + (" (averaged)" if "averaged_accuracy" in r else "")
        accuracy_axis.plot(epochs, r["test_accuracy"], label=label)
    loss_axis.set(xlabel="epoch", ylabel="training loss", yscale="log")
    accuracy_axis.set(xlabel="epoch", ylabel="test accuracy")
    accuracy_axis.set_ylim(0.8, 1.0)
    for axis in (loss_axis, accuracy_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle("keras_thor on scikit-learn digits")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument(
        "--plot", type=pathlib.Path, default="results/digits_comparison.png"
    )
    args = parser.parse_args()
    data = digits()
    steps_per_epoch = -(-len(data[0]) // BATCH)
    results = [
        train(name, optimizer, data, args.epochs)
        for name, optimizer in optimizers(steps_per_epoch, args.epochs).items()
    ]
    print_table(results, args.epochs)
    plot(results, args.plot)


if __name__ == "__main__":
    main()
