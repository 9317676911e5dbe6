"""Step time of ASGD and SAG against `keras.optimizers.SGD`, same run.

An MLP 784-1024-1024-10 on synthetic data, batch 256, trained with
`model.fit` (jit on and off). Each round fits every optimizer for one epoch
of `--steps` steps, interleaved so that machine noise hits all of them
alike. A callback times every step (batch end to batch end); the median
over all rounds is reported, with its ratio to SGD's, and the wall time of
the first epoch (tracing and compiling included).

    python benchmarks/optimizer_step_time.py [--rounds 7] [--steps 20]
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_thor  # noqa: E402

BATCH = 256
OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(learning_rate=0.01),
    # Averaging from step 8 on: the steps timed all average.
    "ASGD(t0=5)": lambda: keras_thor.optimizers.ASGD(learning_rate=0.01, t0=5),
    "SAG(batch_num=10)": lambda: keras_thor.optimizers.SAG(
        learning_rate=0.01, batch_num=10
    ),
}


def mlp():
    init = keras.initializers.GlorotUniform(seed=0)
    return keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(1024, "relu", kernel_initializer=init),
            keras.layers.Dense(1024, "relu", kernel_initializer=init),
            keras.layers.Dense(10, kernel_initializer=init),
        ]
    )


def compiled(make_optimizer, jit_compile):
    model = mlp()
    model.compile(
        optimizer=make_optimizer(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


class StepTimer(keras.callbacks.Callback):
    """Wall time between consecutive batch ends (the logs force a sync)."""

    def __init__(self):
        super().__init__()
        self.seconds = []
        self._last = None

    def on_epoch_begin(self, epoch, logs=None):
        self._last = None

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if self._last is not None:
            self.seconds.append(now - self._last)
        self._last = now


def step_seconds(model, x, y):
    timer = StepTimer()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[timer],
    )
    return timer.seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * BATCH, 784)).astype("float32")
    y = rng.integers(0, 10, size=(args.steps * BATCH,))
    print(
        f"keras {keras.__version__}, backend {keras.backend.backend()}, "
        f"{os.cpu_count()} CPUs, batch {BATCH}, {args.steps} steps x "
        f"{args.rounds} rounds (median step)"
    )
    print(
        f"{'jit':<5} {'optimizer':<20} {'ms/step':>8} {'x SGD':>7} "
        f"{'first epoch s':>14}"
    )
    for jit_compile in (False, True):
        models = {n: compiled(f, jit_compile) for n, f in OPTIMIZERS.items()}
        first_epoch = {}
        for name, model in models.items():  # trace, compile and warm up
            start = time.perf_counter()
            step_seconds(model, x, y)
            first_epoch[name] = time.perf_counter() - start
        times = {name: [] for name in models}
        for _ in range(args.rounds):
            for name, model in models.items():
                times[name].extend(step_seconds(model, x, y))
        baseline = np.median(times["SGD"])
        for name, samples in times.items():
            median = np.median(samples)
            print(
                f"{str(jit_compile):<5} {name:<20} {1e3 * median:>8.2f} "
                f"{median / baseline:>7.3f} {first_epoch[name]:>14.2f}"
            )


if __name__ == "__main__":
    main()
