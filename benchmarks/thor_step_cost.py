"""THOR's step cost against SGD with momentum and against its flop floor.

Benchmark 2 of docs/benchmarks.md, on the two models of benchmark 1
(`thor_time_to_accuracy.py`, same batch sizes). A THOR step that does not
refresh the curvature adds the preconditioning product to an SGD step; per
layer that product costs, relative to the layer's forward and backward
pass (N rows; a convolution divides by its T output positions too):

    direct   A⁻¹·g·G⁻¹:        (d_in + d_out) / (3·N·T)
    factored (A⁻¹aᵀ)(dz·G⁻¹):  (d_in² + d_out² + d_in·d_out) / (3·d_in·d_out)

so the floor of (non-refresh step / SGD step) is 1 + Σ ratio · share, the
share being the layer's part of the model's forward and backward flops, and
the ratio that of the order keras_thor takes (the cheaper one for Dense
layers, the direct one for convolutions).
Measured in `model.fit`, a callback timing every step, median over the
rounds: SGD momentum, THOR's non-refresh step, THOR's refresh step, and the
mean step at frequency 100 (one refresh per 100 steps); then the refresh
step split into capture / inverse / precondition (each piece timed alone as
a traced function), and THOR's state memory against SGD momentum's.
With `--options`, the same refresh and non-refresh steps and refresh split
for each curvature option beyond MindSpore's rule (`OPTIONS`), against the
rule itself.

`--models gpt`: task (f)'s GPT (batch 12 windows of 64), nanoGPT's AdamW
against `THOR.recommended()` and the preset with one setting changed
(`GPT_SETTINGS`), every step of a run timed in `fit`, the runs
interleaved by round; the preset's step split by difference: statistics
(the preset's non-inverting step less that of statistics on inverting
steps only), the guard (less that of no guard), an inversion (its
inverting step less its non-inverting one) and the rest (forward,
backward, preconditioning, momentum).

    python benchmarks/thor_step_cost.py [--models mlp cnn gpt] [--rounds 5]
        [--options [--only NAME ...]]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tasks  # noqa: E402
from tasks import LOSS  # noqa: E402
from tasks import digits  # noqa: E402
from tasks import skipped_share  # noqa: E402

import keras_thor  # noqa: E402
from keras_thor.src.thor import capture  # noqa: E402
from keras_thor.src.thor import training  # noqa: E402
from keras_thor.src.thor.blocks import ConvKronecker  # noqa: E402
from keras_thor.src.thor.preconditioning import plain_direction  # noqa: E402
from keras_thor.src.thor.state_writes import StateWrites  # noqa: E402

# The digits models of benchmark 1's superseded protocol, at its batch
# sizes.
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


class StepTimer(keras.callbacks.Callback):
    """Seconds of every step (batch begin to batch end), by optimizer step.

    Keras calls the train function between the two callbacks, so the time
    is the step's; the step number is read before the clock starts, and the
    loss is read before it stops (JAX dispatches a step asynchronously:
    without the read the clock would time the dispatch only).
    """

    def __init__(self):
        super().__init__()
        self.seconds, self.steps = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.steps.append(int(self.model.optimizer.iterations.numpy()))
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        float(logs["loss"])
        self.seconds.append(time.perf_counter() - self._start)


def thor_or_baseline_model(setup, optimizer):
    keras.utils.set_random_seed(0)
    model = setup["build"]()
    if isinstance(optimizer, keras_thor.optimizers.THOR):
        model = keras_thor.convert_to_thor_model(model)
    model.compile(optimizer=optimizer, loss=LOSS)
    return model


def fit_model(model, x, y, batch, epochs, timer=None):
    model.fit(
        x,
        y,
        batch_size=batch,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[timer] if timer else [],
    )


def layer_costs(model, batch):
    """Per curvature block: (name, d_in, d_out, T, flops share)."""
    layers = []
    for block in model.optimizer.curvature_blocks.values():
        positions = 1
        if isinstance(block, ConvKronecker):
            positions = int(np.prod(block.layer.output.shape[1:-1]))
        layers.append((block.layer.name, block.a_dim, block.g_dim, positions))
    flops = [d_in * d_out * t for _, d_in, d_out, t in layers]
    total = sum(flops)
    return [(*layer, f / total) for layer, f in zip(layers, flops)], batch


def floor_report(costs, batch):
    print(
        f"  {'layer':<16} {'d_in':>5} {'d_out':>5} {'T':>4} {'share':>6} "
        f"{'direct':>7} {'factored':>8} cheaper"
    )
    floor = 1.0
    for name, d_in, d_out, positions, share in costs:
        direct = (d_in + d_out) / (3 * batch * positions)
        factored = (d_in**2 + d_out**2 + d_in * d_out) / (3 * d_in * d_out)
        cheaper = "direct" if direct <= factored else "factored"
        # keras_thor takes the factored order for Dense layers only.
        used = factored if cheaper == "factored" and positions == 1 else direct
        floor += used * share
        print(
            f"  {name:<16} {d_in:>5} {d_out:>5} {positions:>4} {share:>6.3f} "
            f"{direct:>7.3f} {factored:>8.3f} {cheaper}"
        )
    return floor


def median_step(timer, keep):
    return float(
        np.median(
            [s for s, step in zip(timer.seconds, timer.steps) if keep(step)]
        )
    )


def _time(fn, *args, repeats=30):
    """Mean seconds of `fn(*args)`, each call waited for (its result read
    back) before the next."""
    keras.tree.map_structure(keras.ops.convert_to_numpy, fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        keras.tree.map_structure(keras.ops.convert_to_numpy, fn(*args))
    return (time.perf_counter() - start) / repeats


def _compiled(fn):
    """`fn` traced once: a `tf.function` on TensorFlow; on JAX a `jax.jit`
    in a `keras.StatelessScope` (the variables enter as constants, and what
    `fn` assigns stays in the scope)."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    import jax

    def stateless(*args):
        with keras.StatelessScope():
            return fn(*args)

    return jax.jit(stateless)


def refresh_pieces(model, x, y):
    """Seconds of capture, inversion and preconditioning, each alone, as
    compiled functions (`_compiled`) over the backend's own forward and
    backward pass (`training._backend()`, as THOR's step takes it).

    On JAX the inversion is not timed alone (NaN): run as a program of its
    own, the CNN's inversions hang jaxlib 0.10.2 on 2 cores (two batched
    LAPACK calls, each waiting in `ParallelBatchMap` for the 2-thread
    intra-op pool both occupy); `benchmark` prints the refresh step less
    the non-refresh step and the capture instead."""
    thor = model.optimizer
    plan = thor.step_plan
    backend = training._backend()
    blocks = list(thor.estimator.recorded_blocks().values())

    def forward(x, y, recorded):
        def losses(y_pred):
            loss = LOSS(y, y_pred)
            return loss, loss, None

        with capture.thor_training_step():
            return backend.forward_and_gradients(
                model, x, losses, recorded, plan, bool(recorded), False
            )

    @_compiled
    def backward(x, y):
        return forward(x, y, []).grads

    @_compiled
    def backward_and_statistics(x, y):
        result = forward(x, y, blocks)
        scale = keras.ops.cast(keras.ops.shape(x)[0], "float32")
        statistics = thor.estimator.gather(
            result.calls, result.output_grads, scale
        )
        return [g for g in result.grads if g is not None], statistics

    _, statistics = backward_and_statistics(x, y)
    kernels = sorted(statistics)

    @_compiled
    def invert(statistics):
        damping = thor.current_damping()
        estimator, writes = thor.estimator, StateWrites()
        inverses = []
        for i in kernels:
            a, g, seen, accepted = estimator.factors(i, statistics[i], writes)
            factors = (a, g, estimator.pi(i, a, g), seen, accepted)
            inverses.append(estimator.inverses(i, factors, damping))
        return inverses

    grads = backward(x, y)

    joint = plan.joint_biases

    @_compiled
    def precondition(grads):
        damping = thor.current_damping()
        return [
            thor.curvature_blocks[i].precondition_pair(
                grads[i], grads[joint[i]], *thor.estimator.inverses_of(i)
            )
            if i in joint
            else plain_direction(
                thor.curvature_blocks[i],
                grads[i],
                *thor.estimator.inverses_of(i),
                damping,
                float(thor.batch_size),
            )
            for i in kernels
        ]

    plain = _time(backward, x, y)
    captured = _time(backward_and_statistics, x, y)
    inverse = float("nan")
    if keras.backend.backend() == "tensorflow":
        inverse = _time(invert, statistics)
    return captured - plain, inverse, _time(precondition, grads)


def _state_bytes(optimizer):
    return sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        for v in optimizer.variables
    )


def _inverse(alone, remainder):
    """The inversion's milliseconds: timed alone, else (JAX, `~`) the
    refresh step less the non-refresh step and the capture."""
    if np.isnan(alone):
        return f"~{1e3 * remainder:.2f}"
    return f"{1e3 * alone:.2f}"


def benchmark(model_name, rounds):
    setup = SETUPS[model_name]
    batch = setup["batch"]
    x, _, y, _ = digits(0, setup["images"])
    epochs = max(2, -(-200 // (len(x) // batch)))  # >= 200 timed steps

    def thor(frequency):
        return keras_thor.optimizers.THOR(
            0.01,
            setup["damping"],
            0.9,
            frequency=frequency,
            batch_size=batch,
        )

    # The non-refresh run is as long as the frequency-100 one, so that both
    # means average the same mix of epoch-start and inner steps.
    runs = {
        "sgd": thor_or_baseline_model(
            setup, keras.optimizers.SGD(0.01, momentum=0.9)
        ),
        "plain": thor_or_baseline_model(setup, thor(10**9)),
        "refresh": thor_or_baseline_model(setup, thor(2)),
        "frequency 100": thor_or_baseline_model(setup, thor(100)),
    }
    for model in runs.values():  # trace, compile, warm up
        fit_model(model, x, y, batch, 2)
    timers = {name: StepTimer() for name in runs}
    for _ in range(rounds):
        for name, model in runs.items():
            model.optimizer.iterations.assign(0)
            fit_model(
                model,
                x,
                y,
                batch,
                epochs if name in ("plain", "frequency 100") else 1,
                timers[name],
            )
    sgd = median_step(timers["sgd"], lambda s: True)
    plain = median_step(timers["plain"], lambda s: s > 0)  # 0 refreshes
    refresh = median_step(timers["refresh"], lambda s: s % 2 == 0)
    # Means over whole epochs (epoch-start steps included) on both sides.
    mean_f100 = float(np.mean(timers["frequency 100"].seconds))
    mean_plain = float(np.mean(timers["plain"].seconds))

    costs, n = layer_costs(runs["plain"], batch)
    print(f"\n{model_name}: batch {batch}, {rounds} rounds")
    floor = floor_report(costs, n)
    capture_s, inverse_s, precondition_s = refresh_pieces(
        runs["plain"], x[:batch], y[:batch]
    )
    print(
        f"  SGD momentum step        {1e3 * sgd:7.2f} ms\n"
        f"  THOR non-refresh step    {1e3 * plain:7.2f} ms  "
        f"{plain / sgd:.3f}x SGD; flop floor {floor:.3f}x; "
        f"{plain / sgd / floor:.3f}x the floor (target <= 1.25)\n"
        f"  THOR refresh step        {1e3 * refresh:7.2f} ms  "
        f"(capture {1e3 * capture_s:.2f}, "
        f"inverse {_inverse(inverse_s, refresh - plain - capture_s)}, "
        f"precondition {1e3 * precondition_s:.2f} ms, each alone)\n"
        f"  THOR mean step, f=100    {1e3 * mean_f100:7.2f} ms  "
        f"{mean_f100 / mean_plain:.3f}x the mean non-refresh step "
        f"({1e3 * mean_plain:.2f} ms, target <= 1.3)"
    )
    sgd_state = _state_bytes(runs["sgd"].optimizer)
    thor_state = _state_bytes(runs["plain"].optimizer)
    params = sum(
        int(np.prod(w.shape)) * 4 for w in runs["sgd"].trainable_weights
    )
    print(
        f"  optimizer state: SGD momentum {sgd_state / 1024:.1f} KiB, THOR "
        f"{thor_state / 1024:.1f} KiB (momentum + inverses; weights "
        f"{params / 1024:.1f} KiB)"
    )


# Each curvature option alone, then the recommended setting; `rows` is a
# quarter of the batch.
OPTIONS = {
    "MindSpore's rule": {},
    "statistics_rows=batch/4": {"statistics_rows": "rows"},
    "factor_decay=0.95": {"factor_decay": 0.95},
    'fisher="sampled"': {"fisher": "sampled"},
    "kl_clip=0.01": {"kl_clip": 0.01},
    'precondition_biases="all"': {"precondition_biases": "all"},
    "THOR.recommended()": dict(keras_thor.optimizers.THOR.RECOMMENDED),
    # The preset with kfac-pytorch's guard on the direction instead.
    'recommended, kl_clip_mode="direction"': dict(
        keras_thor.optimizers.THOR.RECOMMENDED, kl_clip_mode="direction"
    ),
    "trace_thresholds=0.01": {"trace_thresholds": 0.01},
    'damping_split="pi"': {"damping_split": "pi"},
    'precondition_biases="joint"': {"precondition_biases": "joint"},
    # Every step gathers statistics: the "plain" column is a statistics
    # step that does not invert.
    "statistics every step": {"statistics_frequency": 1, "factor_decay": 0.95},
    # Every refresh after the first skips every inversion: what the trace
    # rule can save at most.
    "trace rule, all skipped": {"trace_thresholds": 1e9},
}


def options_report(model_name, rounds, only=None):
    """Refresh and non-refresh step times and the refresh split of each
    entry of `OPTIONS` (the names in `only`, if given; refreshing every 2
    steps, learning rate 0.01)."""
    setup = SETUPS[model_name]
    batch = setup["batch"]
    x, _, y, _ = digits(0, setup["images"])
    runs = {}
    for name, options in OPTIONS.items():
        if only and name not in only:
            continue
        options = {
            key: batch // 4 if value == "rows" else value
            for key, value in options.items()
        }
        options.setdefault("damping", setup["damping"])
        options.update(learning_rate=0.01, momentum=0.9, frequency=2)
        optimizer = keras_thor.optimizers.THOR(batch_size=batch, **options)
        runs[name] = thor_or_baseline_model(setup, optimizer)
    for model in runs.values():  # trace, compile, warm up
        fit_model(model, x, y, batch, 1)
    timers = {name: StepTimer() for name in runs}
    for _ in range(rounds):
        for name, model in runs.items():
            fit_model(model, x, y, batch, 1, timers[name])
    print(f"\n{model_name}: curvature options, batch {batch}, {rounds} rounds")
    print(
        f"  {'option':<26}{'refresh':>9}{'plain':>8}{'capture':>9}"
        f"{'inverse':>9}{'precond.':>9}{'skipped':>9}  "
        "(ms; split: each piece alone, ~: refresh - plain - capture; "
        "skipped: the share of block inversions the trace rule skipped)"
    )
    for name, model in runs.items():
        timer = timers[name]
        refresh = median_step(timer, lambda s: s % 2 == 0)
        plain = median_step(timer, lambda s: s % 2 == 1)
        capture_s, inverse_s, precondition_s = refresh_pieces(
            model, x[:batch], y[:batch]
        )
        skipped = (
            f"{skipped_share(model.optimizer):9.2f}"
            if model.optimizer.trace_thresholds
            else f"{'-':>9}"
        )
        print(
            f"  {name:<26}{1e3 * refresh:9.2f}{1e3 * plain:8.2f}"
            f"{1e3 * capture_s:9.2f}"
            f"{_inverse(inverse_s, refresh - plain - capture_s):>9}"
            f"{1e3 * precondition_s:9.2f}{skipped}"
        )


# The preset and one setting changed at a time (`--models gpt`).
GPT_SETTINGS = {
    "THOR.recommended()": {},
    "statistics on inverting steps only": {"statistics_frequency": 5},
    "no guard (kl_clip=None)": {"kl_clip": None},
    "statistics_rows=3 (a quarter)": {"statistics_rows": 3},
    "inverses every 10 steps": {"frequency": 10},
}
GPT_BATCH = 12


def _gpt_model(vocabulary, optimizer):
    import gpt

    model = gpt.gpt(vocabulary, seed=0)
    if isinstance(optimizer, keras_thor.optimizers.THOR):
        model = keras_thor.convert_to_thor_model(model)
    model.compile(optimizer=optimizer, loss=gpt.LOSS)
    return model


def gpt_report(rounds, steps=100):
    """nanoGPT's AdamW and `GPT_SETTINGS` on task (f)'s GPT: per-step
    milliseconds (median of inverting and of other steps, and the mean;
    "/AdamW" is mean over mean), then the preset's split by difference
    (module docstring). The flop floor counts every block as a matrix
    product of its widths, the two tables' lookups included (an upper
    bound of their share)."""
    import gpt
    import shakespeare

    text = shakespeare.load()
    x, y = text.training_windows(
        np.random.default_rng(0), steps * GPT_BATCH, gpt.CONTEXT
    )
    vocabulary = len(text.vocabulary)
    runs = {"AdamW (nanoGPT)": _gpt_model(vocabulary, gpt.nanogpt_adamw())}
    for name, options in GPT_SETTINGS.items():
        optimizer = keras_thor.optimizers.THOR.recommended(
            batch_size=GPT_BATCH, **options
        )
        runs[name] = _gpt_model(vocabulary, optimizer)
    for model in runs.values():  # trace, compile, warm up
        fit_model(model, x[: 10 * GPT_BATCH], y[: 10 * GPT_BATCH], GPT_BATCH, 1)
    timers = {name: StepTimer() for name in runs}
    for _ in range(rounds):
        for name, model in runs.items():
            fit_model(model, x, y, GPT_BATCH, 1, timers[name])
    print(
        f"\ngpt: batch {GPT_BATCH} x {gpt.CONTEXT} tokens, {steps} steps x "
        f"{rounds} rounds a setting (ms; inverting / other: medians)"
    )
    costs, rows = layer_costs(
        runs["THOR.recommended()"], GPT_BATCH * gpt.CONTEXT
    )
    floor = floor_report(costs, rows)
    adamw = median_step(timers["AdamW (nanoGPT)"], lambda s: True)
    adamw_mean = float(np.mean(timers["AdamW (nanoGPT)"].seconds))
    print(
        f"  {'setting':<36}{'inverting':>10}{'other':>8}{'mean':>8}"
        f"{'/AdamW':>8}"
    )
    print(
        f"  {'AdamW (nanoGPT)':<36}{'':>10}{1e3 * adamw:8.2f}"
        f"{1e3 * adamw_mean:8.2f}{1.0:8.2f}"
    )
    medians = {}
    for name in GPT_SETTINGS:
        frequency = runs[name].optimizer.frequency
        timer = timers[name]
        inverting = median_step(timer, lambda s, f=frequency: s % f == 0)
        other = median_step(timer, lambda s, f=frequency: s % f != 0)
        mean = float(np.mean(timer.seconds))
        medians[name] = (inverting, other)
        print(
            f"  {name:<36}{1e3 * inverting:10.2f}{1e3 * other:8.2f}"
            f"{1e3 * mean:8.2f}{mean / adamw_mean:8.2f}"
        )
    preset_inverting, preset_other = medians["THOR.recommended()"]
    statistics = preset_other - medians["statistics on inverting steps only"][1]
    guard = preset_other - medians["no guard (kl_clip=None)"][1]
    frequency = runs["THOR.recommended()"].optimizer.frequency
    inversion = (preset_inverting - preset_other) / frequency
    print(
        f"  the preset's step, per step: statistics {1e3 * statistics:.2f}, "
        f"guard {1e3 * guard:.2f}, inversions {1e3 * inversion:.2f} "
        f"(one every {frequency} steps), the rest "
        f"{1e3 * (preset_other - statistics - guard):.2f} ms; AdamW "
        f"{1e3 * adamw:.2f} ms; the rest's flop floor {floor:.3f}x a "
        f"first-order step"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--options",
        action="store_true",
        help="the curvature options' step costs instead",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=tuple(OPTIONS),
        help="with --options: these rows only",
    )
    args = parser.parse_args()
    print(
        f"keras {keras.__version__}, backend {keras.backend.backend()}, "
        f"{os.cpu_count()} CPUs"
    )
    for model_name in args.models:
        if model_name == "gpt":
            gpt_report(args.rounds)
        elif args.options:
            options_report(model_name, args.rounds, args.only)
        else:
            benchmark(model_name, args.rounds)


if __name__ == "__main__":
    main()
