"""Distributed benchmarks: AdaSum against summation, THOR's reductions.

Benchmark of docs/benchmarks.md for docs/distributed.md, on logical CPU
devices of one machine (MirroredStrategy):

1. AdaSum against Keras's plain all-reduce at 4 replicas, global batch
   1024: an MLP on scikit-learn's digits, SGD with momentum 0.9 over a
   small learning-rate grid. Keras's all-reduce averages the replicas'
   gradients (Horovod's `Average`), tried at the base learning rate and at
   4x it (Horovod's linear scaling for summation); AdaSum combines each
   replica's local step at the base rate (the Horovod guide: no scaling).
   Prints the steps each needs to a target test accuracy.
2. THOR at 2 and 4 replicas: the collectives of a refresh step and the step
   times for `split_indices` (one bucket against one per layer) and for
   `spread_inverses` (every replica inverts every layer, or a share).
3. Per-replica XLA (research/keras.md 4.1: XLA-compile each replica's
   forward and backward pass, apply the update outside) against no XLA, at
   2 replicas, for plain SGD steps: the option keras_thor would offer if it
   were faster.

    python benchmarks/distributed.py [--part adasum thor xla] [--seeds 0 1]
"""

import argparse
import functools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * 4,
)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from boost_throughput import StepTimes  # noqa: E402
from tasks import LOSS  # noqa: E402
from tasks import digits  # noqa: E402

import keras_thor  # noqa: E402
from keras_thor.boost import AdaSum  # noqa: E402
from keras_thor.boost import BoostOptimizer  # noqa: E402
from keras_thor.src.backend.traced_ops import traced_op_counts  # noqa: E402

GLOBAL_BATCH = 1024
STEPS_PER_ROUND = 5
ROUNDS = 60
TARGET = 0.95
BASE_RATES = (0.01, 0.03, 0.1, 0.3)


@functools.cache
def strategy(replicas):
    """The MirroredStrategy over `replicas` logical CPUs: one per size (two
    over the same devices collide on collective keys), each with its own
    collective group keys."""

    class KeyedMirroredStrategy(tf.distribute.MirroredStrategy):
        _collective_key_base = 1000 * replicas

    return KeyedMirroredStrategy([f"/cpu:{i}" for i in range(replicas)])


def mlp(width=128, depth=2, seed=0):
    init = keras.initializers.GlorotUniform(seed=seed)
    layers = [keras.Input((64,))]
    layers += [
        keras.layers.Dense(width, "relu", kernel_initializer=init)
        for _ in range(depth)
    ]
    layers.append(keras.layers.Dense(10, kernel_initializer=init))
    return keras.Sequential(layers)


def fit_rounds(model, x, y, batch, rounds, steps, callback, seed=None):
    """`rounds` epochs of `steps` full batches cycling through `(x, y)`
    (reshuffled each pass when `seed` is given)."""
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if seed is not None:
        dataset = dataset.shuffle(len(x), seed=seed)
    model.fit(
        dataset.repeat().batch(batch, drop_remainder=True),
        epochs=rounds,
        steps_per_epoch=steps,
        callbacks=[callback],
        verbose=0,
    )


class StepsToTarget(keras.callbacks.Callback):
    """Records the first step count at which test accuracy >= target."""

    def __init__(self, x_test, y_test):
        super().__init__()
        self.x_test, self.y_test = x_test, y_test
        self.reached = None
        self.accuracy = 0.0

    def on_epoch_end(self, epoch, logs=None):
        logits = self.model.predict(self.x_test, verbose=0, batch_size=512)
        self.accuracy = float(np.mean(logits.argmax(1) == self.y_test))
        if self.reached is None and self.accuracy >= TARGET:
            self.reached = (epoch + 1) * STEPS_PER_ROUND
            self.model.stop_training = True


def adasum_run(combine, rate, seed, data, mirrored):
    x_train, x_test, y_train, y_test = data
    with mirrored.scope():
        keras.utils.set_random_seed(seed)
        model = mlp(seed=seed)
        sgd = keras.optimizers.SGD(rate, momentum=0.9)
        if combine == "adasum":
            model = keras_thor.boost.to_boost_model(model)
            sgd = BoostOptimizer(sgd, adasum=AdaSum(1))
        model.compile(optimizer=sgd, loss=LOSS)
    tracker = StepsToTarget(x_test, y_test)
    fit_rounds(
        model,
        x_train,
        y_train,
        GLOBAL_BATCH,
        ROUNDS,
        STEPS_PER_ROUND,
        tracker,
        seed,
    )
    return tracker


def adasum_benchmark(seeds):
    mirrored = strategy(4)
    configs = {
        "average, base lr": ("average", 1.0),
        "average, 4x lr": ("average", 4.0),
        "adasum, base lr": ("adasum", 1.0),
    }
    print(
        f"\nAdaSum vs all-reduce: 4 replicas, global batch {GLOBAL_BATCH}, "
        f"digits MLP, target {TARGET:.0%} test accuracy, at most "
        f"{ROUNDS * STEPS_PER_ROUND} steps, seeds {seeds}"
    )
    print(f"{'combination':18} {'base lr':>8} {'steps (per seed)':>22}")
    best = {}
    for label, (combine, factor) in configs.items():
        for base in BASE_RATES:
            steps = []
            for seed in seeds:
                data = digits(seed, images=False)
                tracker = adasum_run(
                    combine, base * factor, seed, data, mirrored
                )
                steps.append(tracker.reached)
            shown = ", ".join("-" if s is None else str(s) for s in steps)
            print(f"{label:18} {base:8.2f} {shown:>22}")
            if None not in steps:
                mean = float(np.mean(steps))
                if label not in best or mean < best[label][0]:
                    best[label] = (mean, base)
    print("\nbest per combination (mean steps to target):")
    baseline = min(
        (best[k][0] for k in best if k.startswith("average")), default=None
    )
    for label, (mean, base) in best.items():
        ratio = "" if baseline is None else f"  {mean / baseline:.2f}x"
        print(f"  {label:18} {mean:7.1f} steps at base lr {base}{ratio}")


def thor_run(replicas, thor_args, data, frequency=10, rounds=16):
    x_train, _, y_train, _ = data
    with strategy(replicas).scope():
        keras.utils.set_random_seed(0)
        model = keras_thor.convert_to_thor_model(mlp(width=512, depth=3))
        model.compile(
            optimizer=keras_thor.optimizers.THOR(
                0.05,
                0.1,
                0.9,
                frequency=frequency,
                batch_size=256 // replicas,
                **thor_args,
            ),
            loss=LOSS,
        )
    times = StepTimes()
    fit_rounds(model, x_train, y_train, 256, rounds, frequency, times)
    # The first round traces both step functions.
    steps = np.array(times.times[frequency:])
    refresh = steps[::frequency]
    plain = np.delete(steps, np.arange(0, len(steps), frequency))
    per_replica = traced_op_counts(
        model.train_function.traced_variant("refresh")
    )
    return (
        per_replica["CollectiveReduceV2"] // replicas,
        1000 * np.median(refresh),
        1000 * np.median(plain),
    )


def thor_benchmark(replicas):
    data = digits(0, images=False)
    per_layer = [0, 1, 2]
    configs = {
        "one bucket, all invert": {"spread_inverses": False},
        "per layer, all invert": {
            "split_indices": per_layer,
            "spread_inverses": False,
        },
        "one bucket, spread": {"spread_inverses": True},
        "per layer, spread": {
            "split_indices": per_layer,
            "spread_inverses": True,
        },
    }
    print(
        f"\nTHOR at {replicas} replicas: digits MLP 64-512-512-512-10, "
        "global batch 256, frequency 10, split_dim 128 (median step times "
        "after the first round)"
    )
    print(
        f"{'configuration':24} {'collectives/refresh':>20} "
        f"{'refresh ms':>11} {'plain ms':>9}"
    )
    for label, thor_args in configs.items():
        collectives, refresh, plain = thor_run(replicas, thor_args, data)
        print(f"{label:24} {collectives:20d} {refresh:11.1f} {plain:9.2f}")


class PerReplicaXLA(keras.Sequential):
    """Each replica's forward and backward pass as one XLA computation."""

    def train_step(self, data):
        x, y = data
        loss, grads = self._loss_and_gradients(x, y)
        self.optimizer.apply(grads, self.trainable_weights)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        self._loss_tracker.update_state(
            loss * replicas, sample_weight=tf.shape(x)[0]
        )
        return {"loss": self._loss_tracker.result()}

    @tf.function(jit_compile=True)
    def _loss_and_gradients(self, x, y):
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self._compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        return loss, tape.gradient(loss, self.trainable_weights)


def sgd_step_time(model_class, width, data, steps=300):
    x_train, _, y_train, _ = data
    with strategy(2).scope():
        keras.utils.set_random_seed(0)
        model = model_class(mlp(width=width).layers)
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=LOSS
        )
    times = StepTimes()
    fit_rounds(model, x_train, y_train, 256, 1, steps, times)
    return 1000 * np.median(times.times[steps // 10 :])


def xla_benchmark():
    data = digits(0, images=False)
    print(
        "\nPer-replica XLA at 2 replicas: SGD steps of a digits MLP "
        "64-w-w-10, global batch 256 (median ms per step)"
    )
    print(f"{'width':>6} {'no XLA':>8} {'per-replica XLA':>16} {'ratio':>6}")
    for width in (128, 512):
        plain = sgd_step_time(keras.Sequential, width, data)
        xla = sgd_step_time(PerReplicaXLA, width, data)
        print(f"{width:6d} {plain:8.2f} {xla:16.2f} {xla / plain:6.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = ["adasum", "thor", "xla"]
    parser.add_argument("--part", nargs="+", default=parts, choices=parts)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    print(
        f"keras {keras.__version__}, tensorflow {tf.__version__}, "
        f"{os.cpu_count()} CPUs, 4 logical CPU devices"
    )
    if "adasum" in args.part:
        adasum_benchmark(args.seeds)
    if "thor" in args.part:
        for replicas in (2, 4):
            thor_benchmark(replicas)
    if "xla" in args.part:
        xla_benchmark()


if __name__ == "__main__":
    main()
