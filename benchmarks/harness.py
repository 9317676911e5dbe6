"""THOR benchmark 1's harness: its tasks, its protocol and one timed run.

The protocol (docs/benchmarks.md, "THOR benchmark 1") is fixed here
before THOR runs: the tasks' budgets, caps and batches (`TASKS`; data,
models and metrics in `tasks.py`), the optimizers and their grids
(`LEARNING_RATES`, `grid`, `make_optimizer`) and one run (`run`: the
warm-up outside the clock, the clock over the training steps only, the
checks with the clock stopped, `TimeToTarget`). The phases built on it are
in `phases.py`, the command line in `thor_time_to_accuracy.py`, the
Keras-free reading of the records in `outcomes.py`.

Backend-neutral: nothing here imports TensorFlow (the default backend, the
one THOR trains on); the baselines run on any Keras backend.
"""

import dataclasses
import math
import os
import pathlib
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # THOR trains on TF

import gpt  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import outcomes  # noqa: E402
import shakespeare  # noqa: E402
import tasks  # noqa: E402

import keras_thor  # noqa: E402

# ---------------------------------------------------------------------------
# The protocol

CHECKS_PER_EPOCH = 4
SCHEDULES = ("constant", "cosine")

SGD = "SGD Nesterov"
ADAMW = "AdamW"
MUON = "Muon"
LION = "Lion"
SCHEDULE_FREE = "ScheduleFreeAdamW"
NANOGPT_ADAMW = "AdamW (nanoGPT)"
THOR_MINDSPORE = "THOR (MindSpore rule)"
THOR_RECOMMENDED = "THOR (recommended)"
BASELINES = (SGD, ADAMW, MUON, LION, SCHEDULE_FREE)
# Baselines of one task only: (f) adds nanoGPT's AdamW as nanoGPT trains.
TASK_BASELINES = {"gpt": (NANOGPT_ADAMW,)}
ALL_BASELINES = BASELINES + (NANOGPT_ADAMW,)
THORS = (THOR_MINDSPORE, THOR_RECOMMENDED)
TASK_NAMES = ("digits", "resnet", "autoencoder", "transformer", "mnist_mlp")


def baselines(task):
    """The baselines `task` is tuned and reported against."""
    return BASELINES + TASK_BASELINES.get(task.name, ())


# Learning-rate grids: three values a factor ~3 apart around each
# optimizer's usual rate, per task (fixed before any THOR run).
LEARNING_RATES = {
    SGD: {
        "digits": (0.1, 0.3, 1.0),
        "resnet": (0.1, 0.3, 1.0),
        "autoencoder": (0.001, 0.003, 0.01),
        "transformer": (0.03, 0.1, 0.3),
        "mnist_mlp": (0.03, 0.1, 0.3),
        "gpt": (0.1, 0.3, 1.0),
    },
    ADAMW: {
        "digits": (1e-2, 3e-2, 1e-1),
        "resnet": (3e-3, 1e-2, 3e-2),
        "autoencoder": (3e-4, 1e-3, 3e-3),
        "transformer": (1e-3, 3e-3, 1e-2),
        "mnist_mlp": (1e-3, 3e-3, 1e-2),
        "gpt": (3e-4, 1e-3, 3e-3),
    },
    MUON: {
        "digits": (1e-2, 3e-2, 1e-1),
        "resnet": (3e-3, 1e-2, 3e-2),
        "autoencoder": (3e-3, 1e-2, 3e-2),
        "transformer": (1e-3, 3e-3, 1e-2),
        "mnist_mlp": (1e-3, 3e-3, 1e-2),
        "gpt": (1e-3, 3e-3, 1e-2),
    },
    LION: {
        "digits": (1e-3, 3e-3, 1e-2),
        "resnet": (1e-3, 3e-3, 1e-2),
        "autoencoder": (3e-5, 1e-4, 3e-4),
        "transformer": (1e-3, 3e-3, 1e-2),
        "mnist_mlp": (1e-4, 3e-4, 1e-3),
        "gpt": (1e-4, 3e-4, 1e-3),
    },
    SCHEDULE_FREE: {
        "digits": (1e-2, 3e-2, 1e-1),
        "resnet": (3e-3, 1e-2, 3e-2),
        "autoencoder": (1e-3, 3e-3, 1e-2),
        "transformer": (1e-3, 3e-3, 1e-2),
        "mnist_mlp": (1e-3, 3e-3, 1e-2),
        "gpt": (1e-3, 3e-3, 1e-2),
    },
    # nanoGPT's own point: its rate and schedule (`gpt.NanoGPTSchedule`).
    NANOGPT_ADAMW: {"gpt": (gpt.NANOGPT_RATE,)},
    THOR_MINDSPORE: dict.fromkeys(TASK_NAMES + ("gpt",), (0.03, 0.1, 0.3)),
    # As shipped: the preset's own rate (`grid` adds no schedule).
    THOR_RECOMMENDED: dict.fromkeys(
        TASK_NAMES + ("gpt",),
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
    # A stream of fresh batches (task (f)'s windows): epoch `e` trains on
    # examples `e·epoch_steps·batch ...` in order, `epoch_steps` steps;
    # None: an epoch is a shuffled pass over the training set.
    epoch_steps: int = None
    checks: int = CHECKS_PER_EPOCH  # metric checks an epoch
    # (model) -> str: what a run that stops at the target records of the
    # model there (task (f): a sample of generated text); None: nothing.
    sample: object = None

    def round_target(self, value):
        if self.higher_is_better:
            return _accuracy_target(value)
        return float(f"{_error_target(value):.6g}")

    def reaches(self, value, target):
        return outcomes.reaches(value, target, self.higher_is_better)

    def better(self, a, b):
        """Whether metric `a` is better than `b` (NaN is worst)."""
        return outcomes.better(a, b, self.higher_is_better)


def _test_accuracy(x_train, y_train, x_test, y_test, statistics=None):
    """A loader's result: the training arrays and the test accuracy."""
    return (
        x_train,
        y_train,
        lambda model: tasks.test_accuracy(model, statistics, x_test, y_test),
    )


def _load_digits():
    x_train, x_test, y_train, y_test = tasks.digits(0, images=False)
    return _test_accuracy(x_train, y_train, x_test, y_test)


# Training images over which precise BN recomputes the statistics of (b).
PRECISE_BN_IMAGES = 1000


def _load_resnet():
    x_train, x_test, y_train, y_test = tasks.mnist()
    x_train = x_train.reshape(-1, 28, 28, 1)
    x_test = x_test.reshape(-1, 28, 28, 1)
    statistics = x_train[:PRECISE_BN_IMAGES]
    return _test_accuracy(x_train, y_train, x_test, y_test, statistics)


def _load_autoencoder():
    x_train = tasks.mnist()[0]
    return (
        x_train,
        x_train,
        lambda model: tasks.reconstruction_error(model, x_train),
    )


def _load_mnist_mlp():
    x_train, x_test, y_train, y_test = tasks.mnist()  # flat: (n, 784)
    return _test_accuracy(x_train, y_train, x_test, y_test)


def load_gpt(windows=None):
    """Task (f): `windows` training windows (default: `TASKS["gpt"]`'s
    budget, `budget · epoch_steps · batch`, whatever task calls it; the
    frontier passes its own) drawn once (`GPT_WINDOWS_SEED`, nanoGPT's
    uniform offsets), and the validation loss on the fixed validation
    windows."""
    if windows is None:
        task = TASKS["gpt"]
        windows = task.budget * task.epoch_steps * task.batch
    text = shakespeare.load()
    rng = np.random.default_rng(GPT_WINDOWS_SEED)
    x_train, y_train = text.training_windows(rng, windows, gpt.CONTEXT)
    x_valid, y_valid = text.validation_windows(gpt.CONTEXT)
    return (
        x_train,
        y_train,
        lambda model: tasks.validation_loss(model, x_valid, y_valid),
    )


SAMPLE_CHARACTERS = 300
SAMPLE_TEMPERATURE = 0.8  # nanoGPT's sample.py
SAMPLE_SEED = 0


def gpt_sample(model):
    """(f): `SAMPLE_CHARACTERS` characters after a newline, sampled as
    nanoGPT's sample.py does (temperature 0.8), seed 0."""
    text = shakespeare.load()
    prompt = [text.vocabulary.index("\n")]
    ids = gpt.generate(
        model, prompt, SAMPLE_CHARACTERS, SAMPLE_SEED, SAMPLE_TEMPERATURE
    )
    return text.decode(ids)


def _load_transformer():
    x_train, x_test, y_train, y_test = tasks.marker_order()
    return _test_accuracy(x_train, y_train, x_test, y_test)


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
        loss=tasks.LOSS,
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
        loss=tasks.LOSS,
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
        loss=tasks.LOSS,
        load=_load_transformer,
    ),
    "gpt": Task(
        "gpt",
        "f",
        "character GPT on Shakespeare (nanoGPT's CPU configuration)",
        "validation loss",
        False,
        budget=40,
        cap=1.0,
        batch=12,
        build=lambda: gpt.gpt(len(shakespeare.load().vocabulary)),
        loss=gpt.LOSS,
        load=load_gpt,
        epoch_steps=100,
        checks=1,
        sample=gpt_sample,
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
        loss=tasks.LOSS,
        load=_load_mnist_mlp,
    ),
}
MAIN_TASKS = ("resnet", "autoencoder", "transformer", "mnist_mlp")
GPT_WINDOWS_SEED = 0  # the training windows of (f), the same for every run
QUICK_BUDGETS = {
    "gpt": 2,
    "digits": 4,
    "resnet": 2,
    "autoencoder": 2,
    "transformer": 2,
    "mnist_mlp": 2,
}

# The protocol of record (targets and best baseline points), a copy of
# results/thor_time_to_accuracy_protocol.json as the baseline tune wrote it.
RECORDED_PROTOCOL = pathlib.Path(__file__).with_name(
    "thor_time_to_accuracy_protocol.json"
)
# And of THOR's tune on the same seed (its best points for the report).
RECORDED_THOR_TUNE = pathlib.Path(__file__).with_name(
    "thor_time_to_accuracy_thor_tune.json"
)

# ---------------------------------------------------------------------------
# Grid points and optimizers


def grid(task, name, quick=False):
    """`name`'s grid points on `task`: dicts of lr, schedule, evaluation
    point (ScheduleFreeAdamW: "y" the trained point, "x" the average)."""
    rates = LEARNING_RATES[name].get(task.name, ())
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
    if name == NANOGPT_ADAMW:
        return [dict(lr=lr, schedule="nanogpt", at=None) for lr in rates]
    return [
        dict(lr=lr, schedule=schedule, at=None)
        for lr in rates
        for schedule in SCHEDULES
    ]


def steps_per_epoch(task, x_train):
    return task.epoch_steps or -(-len(x_train) // task.batch)


def stream_orders(task):
    """Each epoch's examples of a stream task (`Task.epoch_steps`), in
    order: fresh batches every epoch, never a second pass."""
    size = task.epoch_steps * task.batch
    return [np.arange(e * size, (e + 1) * size) for e in range(task.budget)]


def learning_rate(point, total_steps):
    if point["schedule"] == "constant":
        return point["lr"]
    return keras.optimizers.schedules.CosineDecay(
        point["lr"], total_steps, alpha=0.0
    )


def mindspore_frequency(steps):
    return max(2, round(steps / MINDSPORE_REFRESHES_PER_EPOCH))


def make_optimizer(name, point, task, steps):
    """`name`'s optimizer at grid `point` on `task` (`steps` an epoch)."""
    rate = learning_rate(point, task.budget * steps)
    if name == SGD:
        return keras.optimizers.SGD(rate, momentum=0.9, nesterov=True)
    if name == ADAMW:
        return keras.optimizers.AdamW(rate)
    if name == NANOGPT_ADAMW:
        return gpt.nanogpt_adamw(point["lr"], batch=task.batch)
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
        # The batch it trains with, as for the MindSpore rule (`N` of the
        # LayerNorm rule, each Dense layer's preconditioning order).
        return keras_thor.optimizers.THOR.recommended(
            learning_rate=rate, batch_size=task.batch
        )
    raise ValueError(name)


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
    read from). `stop`: the evaluation point whose metric stops the run at
    the target (None: the whole budget).
    """

    def __init__(
        self,
        task,
        evaluate,
        steps,
        target,
        stop=None,
        points=("y",),
        cap=None,
        checks=CHECKS_PER_EPOCH,
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


def warm_up(model, x, y, batch):
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
        _fit_once(model, x[: burn_in * batch], y[: burn_in * batch], batch)
    starts = [0, 1]
    frequency = getattr(optimizer, "frequency", None)
    if isinstance(frequency, int) and frequency > 1:
        starts = [0, frequency - 1]
        period = getattr(optimizer, "statistics_period", frequency)
        if isinstance(period, int) and 1 < period < frequency:
            starts += [period - 1, period]
    for start in starts:
        optimizer.iterations.assign(start)
        _fit_once(model, x[:count], y[:count], batch)


def _fit_once(model, x, y, batch):
    """One unshuffled epoch over `x`, `y`."""
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)


def snapshot(model):
    """The model's weights and its optimizer's variables, as arrays."""
    return model.get_weights(), [
        np.array(keras.ops.convert_to_numpy(v))
        for v in model.optimizer.variables
    ]


def restore(model, state):
    """Puts back a `snapshot`."""
    weights, optimizer_values = state
    model.set_weights(weights)
    for variable, value in zip(model.optimizer.variables, optimizer_values):
        variable.assign(value)


def compiled_model(task, make, thor):
    """The task's model (for THOR `convert_to_thor_model` of it), compiled
    with the optimizer `make()` returns, that optimizer built."""
    model = task.build()
    if thor:
        model = keras_thor.convert_to_thor_model(model)
    model.compile(optimizer=make(), loss=task.loss)
    model.optimizer.build(model.trainable_variables)
    return model


def warm_up_and_reset(model, task, data, state, seed):
    """Seeds the shuffles, traces the training functions (`warm_up`) and
    puts back `state` (a `snapshot`); returns the warm-up's seconds.

    Seeded after the model is built (keras_thor 0.1's conversion drew
    initial values it then overwrote; the seeding stays where it was, so
    the shuffles stay those of the recorded runs), before anything is
    traced: the shuffles
    are the same for every optimizer, and no traced function is
    invalidated by re-seeding later.
    """
    x_train, y_train, _ = data
    keras.utils.set_random_seed(seed)
    start = time.perf_counter()
    warm_up(model, x_train, y_train, task.batch)
    seconds = time.perf_counter() - start
    restore(model, state)
    return seconds


def train_timed(model, task, data, tracker, orders=None):
    """The timed training, `tracker` (a `TimeToTarget`) measuring: Keras's
    shuffles, or one `fit` an epoch on the epoch's `orders`, unshuffled."""
    x_train, y_train, _ = data
    if orders is None:
        model.fit(
            x_train,
            y_train,
            batch_size=task.batch,
            epochs=task.budget,
            callbacks=[tracker],
            verbose=0,
        )
        return
    for epoch, order in enumerate(orders):
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
    steps = steps_per_epoch(task, data[0])
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
        model = compiled_model(
            task,
            lambda: (make or make_optimizer)(name, point, task, steps),
            name in THORS,
        )
        record["warmup_seconds"] = warm_up_and_reset(
            model, task, data, snapshot(model), seed
        )
        tracker = TimeToTarget(
            task,
            data[2],
            steps,
            target,
            stop=(point.get("at") or "y") if stop else None,
            points=points,
            cap=None if stop else task.cap,
            checks=task.checks,
        )
        if orders is None and task.epoch_steps:
            orders = stream_orders(task)
        train_timed(model, task, data, tracker, orders)
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
        reached = outcomes.outcome(record, task.higher_is_better)
        if stop and task.sample is not None and reached:
            record["sample"] = task.sample(model)
    except Exception as error:  # noqa: BLE001  (never crash the benchmark)
        traceback.print_exc()
        record["error"] = f"{type(error).__name__}: {error}"
    finally:
        if model is not None:
            tasks.release(model)
    record["wall_seconds"] = time.perf_counter() - start
    return record


def run_thor(task, data, target, options, seed=outcomes.TUNE_SEED):
    """`THOR(batch_size=task.batch, **options)`, a point outside the
    protocol's grids, run as "THOR (recommended)" (the converted model, a
    constant rate) on `seed`, stopping at `target`; the record."""
    point = dict(lr=options["learning_rate"], schedule="constant", at=None)

    def make(_name, _point, task, _steps):
        return keras_thor.optimizers.THOR(batch_size=task.batch, **options)

    return run(
        task, data, THOR_RECOMMENDED, point, seed, target, True, make=make
    )
