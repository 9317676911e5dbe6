"""THOR's sensitivity to learning rate and damping, with and without the guard.

For each task of benchmark 1 (`tasks.py`: (b) the MNIST ResNet, (c) the
deep autoencoder, (d) the marker-order transformer, (e) the MNIST MLP;
(f) nanoGPT's character GPT, `gpt.py`, batch 12, an "epoch" 100 fresh
steps of its windows), a 3x3 grid of learning rate x damping around
`THOR.recommended()` (x1/3, x1, x3 each), trained for a short budget on
the held-out seed 0, once with the recommended setting and once without
its step-size guard (`kl_clip=None`). A run diverges when its final
training loss (over the whole training set, at the end, with
BatchNormalization's statistics recomputed over the training images;
(f): its validation loss, the training windows being a stream) is not
below the initial one (the same measure before the first step), or is
not finite. Prints a table per task and the count of runs that diverged.

    python benchmarks/thor_sensitivity.py [--tasks resnet autoencoder
        transformer mnist_mlp gpt] [--settings recommended unguarded]
        [--epochs 2] [--seed 0] [--options JSON]

`--options` are more `THOR.recommended()` overrides for every run, e.g.
`--options '{"adaptive_damping": true}'`.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gpt  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import shakespeare  # noqa: E402
import tasks  # noqa: E402

import keras_thor  # noqa: E402

BATCH = 128
GPT_BATCH = 12
GPT_EPOCH_STEPS = 100
TASKS = ("resnet", "autoencoder", "transformer", "mnist_mlp", "gpt")
DEFAULT_TASKS = TASKS[:-1]  # (f) on request (`--tasks gpt`): the longest
SCALES = (1 / 3, 1.0, 3.0)


def batch_size(name):
    return GPT_BATCH if name == "gpt" else BATCH


def _gpt_setup(epochs):
    """(f): `epochs · 100` steps of fresh windows (seed 0, as the
    benchmark's), trained in one pass; the divergence measure is the
    validation loss."""
    text = shakespeare.load()
    x, y = text.training_windows(
        np.random.default_rng(0),
        epochs * GPT_EPOCH_STEPS * GPT_BATCH,
        gpt.CONTEXT,
    )
    x_valid, y_valid = text.validation_windows(gpt.CONTEXT)

    def validation_loss(model):
        return tasks.validation_loss(model, x_valid, y_valid)

    return (
        gpt.gpt(len(text.vocabulary)),
        gpt.LOSS,
        x,
        y,
        validation_loss,
        lambda model, _loss, _x, _y: validation_loss(model),
    )


def task_setup(name, epochs):
    """`(model, loss, x, y, metric, divergence_loss)` of a task;
    `metric(model)` is its benchmark metric (test accuracy, training
    reconstruction error, validation loss), `divergence_loss(model, loss,
    x, y)` what a run must lower."""
    if name == "gpt":
        return _gpt_setup(epochs)
    return (*_setup(name), training_loss)


def _setup(name):
    if name == "resnet":
        x, x_test, y, y_test = tasks.mnist()
        x, x_test = x.reshape(-1, 28, 28, 1), x_test.reshape(-1, 28, 28, 1)
        return (
            tasks.mnist_resnet(),
            tasks.LOSS,
            x,
            y,
            lambda m: tasks.test_accuracy(m, x[:1000], x_test, y_test),
        )
    if name == "mnist_mlp":
        x, x_test, y, y_test = tasks.mnist()
        return (
            tasks.mnist_mlp(),
            tasks.LOSS,
            x,
            y,
            lambda m: tasks.test_accuracy(m, None, x_test, y_test),
        )
    if name == "autoencoder":
        x = tasks.mnist()[0]
        return (
            tasks.autoencoder(),
            tasks.sigmoid_cross_entropy,
            x,
            x,
            lambda m: tasks.reconstruction_error(m, x),
        )
    x, x_test, y, y_test = tasks.marker_order()
    return (
        tasks.transformer(),
        tasks.LOSS,
        x,
        y,
        lambda m: tasks.test_accuracy(m, x[:10], x_test, y_test),
    )


def batch_loss(model, loss, x, y):
    return float(keras.ops.mean(loss(y, model(x, training=False))))


def training_loss(model, loss, x, y):
    """The mean loss over the training set, with BatchNormalization's
    statistics recomputed over it at the current weights (as the benchmark's
    metrics: the moving averages lag behind fast-changing weights), and put
    back afterwards."""
    norms = list(tasks.batch_normalizations(model))
    moving = [v for norm in norms for v in norm.non_trainable_variables]
    saved = [keras.ops.convert_to_numpy(v) for v in moving]
    momenta = [norm.momentum for norm in norms]
    for norm in norms:
        norm.momentum = 0.0
    try:
        if norms:
            model(x[:1000], training=True)
        value = np.mean(
            [
                batch_loss(model, loss, x[i : i + 1000], y[i : i + 1000])
                for i in range(0, len(x), 1000)
            ]
        )
    finally:
        for norm, momentum in zip(norms, momenta):
            norm.momentum = momentum
        for variable, value_ in zip(moving, saved):
            variable.assign(value_)
    return float(value)


def run(name, guarded, learning_rate, damping, epochs, seed, options):
    keras.utils.set_random_seed(seed)
    model, loss, x, y, metric, divergence_loss = task_setup(name, epochs)
    model = keras_thor.convert_to_thor_model(model)
    batch = batch_size(name)
    overrides = dict(options) if guarded else {**options, "kl_clip": None}
    model.compile(
        optimizer=keras_thor.optimizers.THOR.recommended(
            learning_rate=learning_rate,
            damping=damping,
            batch_size=batch,
            **overrides,
        ),
        loss=loss,
    )
    initial = divergence_loss(model, loss, x, y)
    passes = 1 if name == "gpt" else epochs  # (f): a stream, one pass
    model.fit(x, y, batch_size=batch, epochs=passes, verbose=0)
    final = divergence_loss(model, loss, x, y)
    diverged = not (np.isfinite(final) and final < initial)
    return initial, final, metric(model), diverged


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tasks", nargs="+", default=list(DEFAULT_TASKS), choices=TASKS
    )
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["recommended", "unguarded"],
        choices=["recommended", "unguarded"],
        help="the recommended setting, and/or it without the guard",
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--options", default="{}")
    args = parser.parse_args()
    options = json.loads(args.options)
    centre = keras_thor.optimizers.THOR.RECOMMENDED
    for name in args.tasks:
        print(
            f"\n{name}: {args.epochs} epochs, seed {args.seed}, batch "
            f"{batch_size(name)}"
        )
        print(
            f"{'setting':<22}{'lr':>7}{'damping':>9}{'initial':>10}"
            f"{'final':>11}{'metric':>8}  diverged"
        )
        for guarded in [s == "recommended" for s in args.settings]:
            setting = "recommended" if guarded else "without the guard"
            diverged = 0
            for lr_scale in SCALES:
                for damping_scale in SCALES:
                    lr = centre["learning_rate"] * lr_scale
                    damping = centre["damping"] * damping_scale
                    initial, final, metric, bad = run(
                        name,
                        guarded,
                        lr,
                        damping,
                        args.epochs,
                        args.seed,
                        options,
                    )
                    diverged += bad
                    print(
                        f"{setting:<22}{lr:>7.3g}{damping:>9.3g}"
                        f"{initial:>10.4g}{final:>11.4g}{metric:>8.4f}  "
                        f"{'yes' if bad else 'no'}",
                        flush=True,
                    )
            print(f"{setting}: {diverged} of 9 runs diverged", flush=True)


if __name__ == "__main__":
    main()
