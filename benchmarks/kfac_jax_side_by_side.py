"""kfac-jax side by side with THOR benchmark 1, in the same run (issue 24).

kfac-jax 0.0.8 (fixed mode, its README's advice for stochastic training)
trains a task of benchmark 1 (`harness.py`) from the same data, the same
initial weights (exported from the Keras model the benchmark builds) and
the same batches, and is measured the same way: the metric
`checks_per_epoch` times an epoch (the task's value in the protocol file)
with the clock stopped, epochs and seconds to the protocol's stored target,
and separately the seconds of XLA compilation.

Two halves in two virtualenvs (kfac-jax never becomes a dependency of
keras_thor):

1. `--export`, in the main `.venv`: for each task and seed, builds the
   Keras model exactly as benchmark 1 does (`set_random_seed(seed)`, then
   the task's build) and writes `results/kfac_jax/<task>_data.npz` (the
   arrays as benchmark 1 loads them) and `<task>_seed<seed>.npz` (the
   initial weights, the layer activations or the ResNet's weight paths,
   one permutation of the training set per epoch, the Keras model's
   metric, loss and logits at the initial weights for the cross-check).
2. `--run`, `--grid`, `--report`, in `.venv-kfac` (`make kfac-jax-venv`,
   from `benchmarks/requirements-kfac-jax.txt`): the same model as plain
   JAX functions, checked against the Keras numbers before training: a
   Dense stack (kfac-jax's graph matcher registers each `x @ w + b`) or
   (b)'s ResNet (`ResNetModel`: convolutions, BatchNormalization by the
   batch, precise BN for the metric as benchmark 1).

The shuffles are explicit: epoch e takes `permutations(seed, n, epochs)[e]`
(NumPy, from the seed), batches of `batch` in that order, the last one
partial, as Keras's `fit` batches. Keras's own `fit(shuffle=True)` draws
other orders: THOR's side-by-side run must take these permutations (fit
one epoch at a time on `x[order]` with `shuffle=False`, or a generator;
`permutations` needs NumPy only).

kfac-jax's settings: `use_adaptive_learning_rate`, `use_adaptive_momentum`
and `use_adaptive_damping` False, learning rate lr, momentum 0.9, damping
lambda (constants passed to each step), its defaults `curvature_ema=0.95`,
`curvature_update_period=1`, `inverse_update_period=5`,
`num_burnin_steps=10`, `estimation_mode` None (its estimator's default
`ggn_curvature_prop`), `norm_constraint=None`, `l2_reg=0`. The 10 burn-in
batches update the curvature only and count as data seen: they are the
first 10 batches of epoch 0, and their compute runs on the clock (a check
that falls among them sees the initial weights).

Seconds: the clock runs over each `step` call (batch fetch included) up
to its result, as benchmark 1's clock runs over Keras's train step.
Compilation (tracing, graph matching, XLA) is timed apart, once per task
and process, since lr, momentum and damping are arguments of the compiled
step: the first step (with its burn-in) and a partial-batch step, cold
less warm. Columns: `s` training seconds to the target, `s+compile` the
same plus the compile seconds, `s/epoch` the steady training seconds an
epoch (burn-in included).

Grid (`GRIDS`): damping lambda x lr / lambda on seed 0, each point stopped
at the target; best point = fewest epochs to the target, ties less time
(benchmark 1's `outcomes.select`, which needs no Keras; closest final
metric if no point reaches it); `--report` runs it on seeds 1-3.
`--quick`: the middle grid point, 2 epochs, one report seed, files
`results/quick_kfac_jax_side_by_side_*`.

`--thor` (main `.venv`) trains `THOR.recommended(batch_size=...)` as
shipped on the same exported permutations, seeds 0-3, through benchmark
1's `harness.run` (its warm-up, clock and checks; one `fit` per epoch on
`x[order]`), and writes `results/kfac_jax_side_by_side_thor.json`.

    .venv/bin/python benchmarks/kfac_jax_side_by_side.py --export \\
        --tasks autoencoder mnist_mlp resnet
    make kfac-jax-venv
    .venv-kfac/bin/python benchmarks/kfac_jax_side_by_side.py --run \\
        --tasks autoencoder --damping 1 --lr 0.01 --epochs 2   # a point
    .venv-kfac/bin/python benchmarks/kfac_jax_side_by_side.py --grid \\
        --tasks autoencoder mnist_mlp
    .venv-kfac/bin/python benchmarks/kfac_jax_side_by_side.py --report \\
        --tasks autoencoder mnist_mlp
    .venv/bin/python benchmarks/kfac_jax_side_by_side.py --thor \\
        --tasks mnist_mlp
"""

import argparse
import json
import math
import os
import pathlib
import sys
import time
import warnings

import numpy as np
import outcomes
from outcomes import REPORT_SEEDS
from outcomes import TUNE_SEED
from outcomes import fmt
from outcomes import say

HERE = pathlib.Path(__file__).resolve().parent
EXPORT_DIR = HERE.parent / "results" / "kfac_jax"
PREFIX = HERE.parent / "results" / "kfac_jax_side_by_side"

SEEDS = (TUNE_SEED, *REPORT_SEEDS)
TASK_NAMES = ("autoencoder", "mnist_mlp", "resnet")

# kfac-jax's fixed mode with its library defaults.
MOMENTUM = 0.9
CURVATURE_EMA = 0.95
INVERSE_UPDATE_PERIOD = 5
BURNIN_STEPS = 10

# Damping lambda x lr / lambda. The autoencoder's loss is summed over the
# 784 pixels (its curvature and gradients ~784x those of a mean), the MLP's
# is a mean over the batch: kfac-jax scales the damping with the objective.
GRIDS = {
    "autoencoder": dict(damping=(0.1, 1.0, 10.0), ratio=(0.003, 0.01, 0.03)),
    "mnist_mlp": dict(damping=(1e-4, 1e-3, 1e-2), ratio=(0.3, 1.0, 3.0)),
    "resnet": dict(damping=(1e-4, 1e-3, 1e-2), ratio=(0.3, 1.0, 3.0)),
}

# The stream of the per-epoch permutations (NumPy, independent of Keras's
# and TF's random state).
PERMUTATION_STREAM = 24


def permutations(seed, count, epochs):
    """`epochs` permutations of `range(count)`, one per epoch, from `seed`
    (the shuffles both sides of the comparison take)."""
    rng = np.random.default_rng([PERMUTATION_STREAM, seed])
    return np.stack([rng.permutation(count) for _ in range(epochs)]).astype(
        np.int32
    )


def _paths(task, seed):
    return (
        EXPORT_DIR / f"{task}_data.npz",
        EXPORT_DIR / f"{task}_seed{seed}.npz",
    )


# ---------------------------------------------------------------------------
# Export (main .venv: Keras, TensorFlow, keras_thor)


def _eval_arrays(name, tasks):
    """(x, y) of the task's metric, as benchmark 1's loader measures it."""
    x_train, x_test, _, y_test = tasks.mnist()
    if name == "autoencoder":
        return x_train, x_train
    if name == "resnet":
        return x_test.reshape(-1, 28, 28, 1), y_test
    return x_test, y_test


def _structure(name, model, keras, tasks):
    """What the JAX side rebuilds: `(meta fields, per-seed arrays)`.

    A Dense stack: its activations. The ResNet (b): its stem's and blocks'
    strides (the names of `tasks._resnet`) and each weight's path.
    """
    layers = [
        layer
        for layer in model.layers
        if not isinstance(layer, keras.layers.InputLayer)
    ]
    if name == "resnet":
        fields = dict(
            model="resnet",
            stem_strides=tasks.RESNET_STEM_STRIDES,
            blocks=[["block1", 1], ["block2", 2]],
        )
        return fields, dict(
            weight_paths=np.array([v.path for v in model.weights])
        )
    if not all(isinstance(la, keras.layers.Dense) for la in layers):
        raise RuntimeError(f"{name}: not a stack of Dense layers")
    activations = [la.get_config()["activation"] for la in layers]
    return dict(model="dense"), dict(activations=np.array(activations))


def export(names, seeds):
    """Writes each task's data and each seed's weights and shuffles."""
    import harness
    import keras
    import tasks

    protocol = json.loads(harness.RECORDED_PROTOCOL.read_text())
    EXPORT_DIR.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name not in harness.TASKS:
            say(f"{name}: not a task of benchmark 1 (yet)")
            continue
        task = harness.TASKS[name]
        x_train, y_train, evaluate = task.load()
        x_eval, y_eval = _eval_arrays(name, tasks)
        flat = x_train.reshape(len(x_train), -1)
        if not np.array_equal(flat, tasks.mnist()[0]):
            raise RuntimeError(f"{name}: training images are not mnist()'s")
        stored = protocol.get(name, {})
        sigmoid = task.loss is tasks.sigmoid_cross_entropy
        meta = dict(
            task=name,
            title=task.title,
            metric=task.metric,
            higher_is_better=task.higher_is_better,
            batch=task.batch,
            budget=task.budget,
            checks_per_epoch=stored.get(
                "checks_per_epoch", harness.CHECKS_PER_EPOCH
            ),
            target=stored.get("target"),
            loss="sigmoid_sum" if sigmoid else "softmax_mean",
            keras=keras.__version__,
        )
        data_path, _ = _paths(name, 0)
        arrays = dict(x_train=x_train, x_eval=x_eval, y_eval=y_eval)
        if not sigmoid:
            arrays["y_train"] = y_train
        statistics = None
        if name == "resnet":
            statistics = x_train[: harness.PRECISE_BN_IMAGES]
            arrays["x_statistics"] = statistics
        for seed in seeds:
            keras.utils.set_random_seed(seed)
            model = task.build()
            fields, structure = _structure(name, model, keras, tasks)
            weights = model.get_weights()
            order = permutations(seed, len(x_train), 1)[0][: task.batch]
            first, targets = x_train[order], y_train[order]
            metric = float(evaluate(model))
            with tasks.precise_batch_norm(model, statistics):
                logits = model(x_eval[:16], training=False)
            # Training mode: a BatchNormalization normalizes by the batch.
            loss = keras.ops.mean(
                task.loss(targets, model(first, training=True))
            )
            check = dict(
                metric=metric,
                loss=float(keras.ops.convert_to_numpy(loss)),
                logits=keras.ops.convert_to_numpy(logits),
            )
            tasks.release(model)
            _, seed_path = _paths(name, seed)
            np.savez(
                seed_path,
                permutations=permutations(seed, len(x_train), task.budget),
                check_metric=check["metric"],
                check_loss=check["loss"],
                check_logits=check["logits"],
                **structure,
                **{f"weight{i}": w for i, w in enumerate(weights)},
            )
            say(
                f"wrote {seed_path}: {len(weights)} weights, initial "
                f"{task.metric} {check['metric']:.6g}, first-batch loss "
                f"{check['loss']:.6g}"
            )
        meta.update(fields)
        np.savez(data_path, meta=json.dumps(meta), **arrays)
        say(f"wrote {data_path}: {meta}")


def thor(names, seeds):
    """`THOR.recommended()` on the exported permutations: per task, its
    records and the medians over the report seeds."""
    import harness

    out = {}
    for name in names:
        task = harness.TASKS[name]
        data = task.load()
        meta = _meta(name)
        point = dict(
            lr=harness.LEARNING_RATES[harness.THOR_RECOMMENDED][name][0],
            schedule="constant",
            at=None,
        )
        records = []
        for seed in seeds:
            orders = load(name, seed)[4]
            record = harness.run(
                task,
                data,
                harness.THOR_RECOMMENDED,
                point,
                seed,
                meta["target"],
                True,
                orders=orders,
            )
            got = outcomes.outcome(record, task.higher_is_better)
            record["to_target"] = (
                dict(epochs=got[0], seconds=got[1]) if got else None
            )
            records.append(record)
            say(
                f"[{name}] THOR.recommended() seed {seed}: "
                f"{outcomes.summary(record, task.higher_is_better)}"
            )
        reported = [r["to_target"] or {} for r in records if r["seed"] != 0]
        medians = {
            key: outcomes.median([g.get(key, math.inf) for g in reported])
            for key in ("epochs", "seconds")
        }
        say(f"[{name}] THOR.recommended() medians, seeds 1-3: {medians}")
        out[name] = dict(point=point, medians=medians, runs=records)
    return out


# ---------------------------------------------------------------------------
# kfac-jax (.venv-kfac: JAX 0.9.0, kfac-jax 0.0.8)


def load(name, seed):
    """(meta, arrays, weights, structure, permutations, check); the
    structure is a Dense stack's activations or the ResNet's weight paths."""
    data_path, seed_path = _paths(name, seed)
    for path in (data_path, seed_path):
        if not path.exists():
            sys.exit(
                f"{path} is missing: run `.venv/bin/python {__file__} "
                f"--export --tasks {name}` in the main virtualenv first"
            )
    data = np.load(data_path)
    meta = json.loads(str(data["meta"]))
    arrays = {k: data[k] for k in data.files if k != "meta"}
    if "y_train" not in arrays:
        arrays["y_train"] = arrays["x_train"]
    per_seed = np.load(seed_path)
    count = len([k for k in per_seed.files if k[6:].isdigit()])
    weights = [per_seed[f"weight{i}"] for i in range(count)]
    check = dict(
        metric=float(per_seed["check_metric"]),
        loss=float(per_seed["check_loss"]),
        logits=per_seed["check_logits"],
    )
    key = "weight_paths" if meta.get("model") == "resnet" else "activations"
    return (
        meta,
        arrays,
        weights,
        [str(a) for a in per_seed[key]],
        per_seed["permutations"],
        check,
    )


class Model:
    """The task's Dense stack and loss as plain JAX functions."""

    def __init__(self, meta, activations):
        import jax
        import jax.numpy as jnp
        import kfac_jax

        functions = dict(relu=jax.nn.relu, tanh=jnp.tanh, linear=lambda x: x)
        for activation in activations:
            if activation not in functions:
                raise ValueError(f"activation {activation!r} not supported")
        self.activations = [functions[a] for a in activations]
        self.sigmoid = meta["loss"] == "sigmoid_sum"

        def logits(params, x):
            for (w, b), activation in zip(params, self.activations):
                x = activation(x @ w + b)
            return x

        def loss(params, batch):
            x, y = batch
            out = logits(params, x)
            if self.sigmoid:
                # tasks.sigmoid_cross_entropy: summed over the pixels, the
                # mean over the batch (kfac-jax's registration: the same).
                kfac_jax.register_sigmoid_cross_entropy_loss(out, y)
                y = y.astype(out.dtype)
                each = jnp.maximum(out, 0.0) - out * y
                each = each + jnp.log1p(jnp.exp(-jnp.abs(out)))
                return jnp.mean(jnp.sum(each, axis=-1))
            # Keras's SparseCategoricalCrossentropy(from_logits=True).
            kfac_jax.register_softmax_cross_entropy_loss(out, y)
            log_p = jax.nn.log_softmax(out)
            picked = jnp.take_along_axis(log_p, y[:, None], axis=1)
            return -jnp.mean(picked)

        self.logits = logits
        self.loss = loss
        self.forward = jax.jit(logits)
        self.batch_loss = jax.jit(loss)

    def params(self, weights):
        """The exported weights as `[(kernel, bias), ...]`."""
        return [(weights[i], weights[i + 1]) for i in range(0, len(weights), 2)]

    def predict(self, params, x, batch=1000):
        return np.concatenate(
            [
                np.asarray(self.forward(params, x[i : i + batch]))
                for i in range(0, len(x), batch)
            ]
        )

    def metric(self, params, x_eval, y_eval):
        """tasks.reconstruction_error or tasks.test_accuracy."""
        logits = self.predict(params, x_eval)
        if self.sigmoid:
            sigmoid = 0.5 * (1.0 + np.tanh(0.5 * logits))
            return float(np.mean(np.square(sigmoid - x_eval)))
        if not np.all(np.isfinite(logits)):
            return float("nan")
        return float(np.mean(np.argmax(logits, axis=1) == y_eval))


class ResNetModel:
    """Task (b)'s ResNet (`tasks._resnet`) and loss as plain JAX functions.

    Training normalizes each BatchNormalization by its batch (biased
    variance, ε 10⁻³, as Keras); the metric is benchmark 1's: precise BN
    (each normalization's mean and variance over the exported
    `x_statistics` at the current weights), then the test accuracy.
    kfac-jax's graph matcher registers the convolutions (Kronecker
    factored), the normalizations' scale and shift (diagonal) and the Dense
    layer.
    """

    EPSILON = 1e-3

    def __init__(self, meta, weight_paths, statistics):
        import jax
        import jax.numpy as jnp
        import kfac_jax

        self.paths = weight_paths
        self.statistics = statistics

        def conv(x, kernel, strides):
            return jax.lax.conv_general_dilated(
                x,
                kernel,
                (strides, strides),
                "SAME",
                dimension_numbers=("NHWC", "HWIO", "NHWC"),
            )

        def normalized(x, layer, moments, used):
            if moments is None:
                mean = jnp.mean(x, axis=(0, 1, 2))
                variance = jnp.mean(jnp.square(x - mean), axis=(0, 1, 2))
            else:
                mean, variance = moments[len(used)]
            used.append((mean, variance))
            x = (x - mean) * jax.lax.rsqrt(variance + self.EPSILON)
            return x * layer["gamma"] + layer["beta"]

        def block(p, x, name, strides, moments, used):
            y = conv(x, p[f"{name}_conv1"]["kernel"], strides)
            y = jax.nn.relu(normalized(y, p[f"{name}_bn1"], moments, used))
            y = conv(y, p[f"{name}_conv2"]["kernel"], 1)
            y = normalized(y, p[f"{name}_bn2"], moments, used)
            if f"{name}_proj" in p:
                x = conv(x, p[f"{name}_proj"]["kernel"], strides)
                x = normalized(x, p[f"{name}_proj_bn"], moments, used)
            return jax.nn.relu(y + x)

        def logits_and_moments(p, x, moments=None):
            used = []
            x = conv(x, p["stem"]["kernel"], meta["stem_strides"])
            x = jax.nn.relu(normalized(x, p["stem_bn"], moments, used))
            for name, strides in meta["blocks"]:
                x = block(p, x, name, strides, moments, used)
            x = jnp.mean(x, axis=(1, 2))
            return x @ p["logits"]["kernel"] + p["logits"]["bias"], used

        def loss(params, batch):
            x, y = batch
            out = logits_and_moments(params, x)[0]
            kfac_jax.register_softmax_cross_entropy_loss(out, y)
            log_p = jax.nn.log_softmax(out)
            picked = jnp.take_along_axis(log_p, y[:, None], axis=1)
            return -jnp.mean(picked)

        self.loss = loss
        self.batch_loss = jax.jit(loss)
        self.moments = jax.jit(lambda p, x: logits_and_moments(p, x)[1])
        self.forward = jax.jit(lambda p, x, m: logits_and_moments(p, x, m)[0])

    def params(self, weights):
        """`{layer: {weight: array}}` of the trained weights (the moving
        statistics left out: the metric recomputes them)."""
        params = {}
        for path, weight in zip(self.paths, weights):
            layer, name = path.split("/")[-2:]
            if name not in ("moving_mean", "moving_variance"):
                params.setdefault(layer, {})[name] = weight
        return params

    def predict(self, params, x, batch=1000):
        moments = self.moments(params, self.statistics)
        return np.concatenate(
            [
                np.asarray(self.forward(params, x[i : i + batch], moments))
                for i in range(0, len(x), batch)
            ]
        )

    def metric(self, params, x_eval, y_eval):
        """tasks.test_accuracy with precise BN."""
        logits = self.predict(params, x_eval)
        if not np.all(np.isfinite(logits)):
            return float("nan")
        return float(np.mean(np.argmax(logits, axis=1) == y_eval))


def _reached(meta, record):
    """(epochs, seconds) at the first check at the record's target, or
    None."""
    return outcomes.reached(
        record["epochs"],
        record["seconds"],
        record["metrics"],
        record["target"],
        meta["higher_is_better"],
    )


# Per task, for the process: the JAX model (its jitted forward pass) and
# the compiled kfac-jax optimizer with its compile seconds.
_MODELS, _COMPILED = {}, {}


def _copy(tree):
    import jax
    import jax.numpy as jnp

    return jax.tree.map(jnp.copy, tree)


def run(name, seed, damping, lr, epochs=None, stop=True):
    """One grid point on one seed; returns a JSON-ready record."""
    import jax
    import jax.numpy as jnp
    import kfac_jax

    warnings.filterwarnings("ignore", message=".*donated buffers.*")
    meta, arrays, weights, structure, orders, check = load(name, seed)
    x_train, y_train = arrays["x_train"], arrays["y_train"]
    x_eval, y_eval = arrays["x_eval"], arrays["y_eval"]
    batch = meta["batch"]
    budget = epochs or meta["budget"]
    if budget > len(orders):
        raise ValueError(f"{budget} epochs, {len(orders)} permutations stored")
    steps = -(-len(x_train) // batch)
    checks = meta["checks_per_epoch"]
    check_after = sorted(
        {int(math.ceil(steps * (i + 1) / checks)) for i in range(checks)}
    )
    target = meta["target"] if stop else None
    record = dict(
        task=name,
        optimizer="kfac-jax",
        point=dict(damping=damping, lr=lr),
        seed=seed,
        target=meta["target"],
        budget=budget,
        epochs=[],
        seconds=[],
        losses=[],
        metrics=[],
        diverged=False,
        error=None,
        jax=jax.__version__,
        kfac_jax=kfac_jax.__version__,
    )
    start = time.perf_counter()
    if name not in _MODELS:
        if meta.get("model") == "resnet":
            _MODELS[name] = ResNetModel(meta, structure, arrays["x_statistics"])
        else:
            _MODELS[name] = Model(meta, structure)
    model = _MODELS[name]
    params0 = model.params(weights)

    # The cross-check against the Keras model at the initial weights.
    jparams = jax.tree.map(jnp.asarray, params0)
    metric0 = model.metric(jparams, x_eval, y_eval)
    logits0 = model.predict(jparams, x_eval[:16])
    first = orders[0][:batch]
    loss0 = float(model.batch_loss(jparams, (x_train[first], y_train[first])))
    record["initial"] = dict(
        metric=metric0, keras_metric=check["metric"], loss=loss0
    )
    scale = max(1.0, float(np.max(np.abs(check["logits"]))))
    if not (
        np.allclose(logits0, check["logits"], rtol=1e-4, atol=1e-4 * scale)
        and math.isclose(loss0, check["loss"], rel_tol=1e-4)
        and math.isclose(metric0, check["metric"], rel_tol=1e-4, abs_tol=1e-6)
    ):
        raise RuntimeError(
            f"{name} seed {seed}: the JAX model differs from Keras's at the "
            f"initial weights: metric {metric0} vs {check['metric']}, loss "
            f"{loss0} vs {check['loss']}, logits max difference "
            f"{np.max(np.abs(logits0 - check['logits'])):.3g}"
        )

    def batches():
        """Every batch of the budget in order, last of an epoch partial."""
        for order in orders[:budget]:
            for i in range(0, len(order), batch):
                index = order[i : i + batch]
                yield x_train[index], y_train[index]

    hyper = dict(
        learning_rate=jnp.asarray(lr, jnp.float32),
        momentum=jnp.asarray(MOMENTUM, jnp.float32),
        damping=jnp.asarray(damping, jnp.float32),
    )
    rng = jax.random.PRNGKey(seed)
    rng, init_rng = jax.random.split(rng)
    x_full = x_train[orders[0][:batch]], y_train[orders[0][:batch]]
    remainder = len(x_train) % batch
    tail = orders[0][len(x_train) - remainder :] if remainder else None

    def warm_steps(state):
        """Step 0 with its burn-in and a partial-batch step, on copies."""
        params = _copy(jparams)
        state = optimizer.copy_obj(state)
        stream = iter([x_full] * (BURNIN_STEPS + 1))
        params, state, _ = optimizer.step(
            params, state, rng, data_iterator=stream, global_step_int=0, **hyper
        )
        if tail is not None:
            params, state, _ = optimizer.step(
                params,
                state,
                rng,
                batch=(x_train[tail], y_train[tail]),
                global_step_int=1,
                **hyper,
            )
        jax.block_until_ready(params)

    if name in _COMPILED:
        optimizer, compile_seconds = _COMPILED[name]
        state = optimizer.init(jparams, init_rng, x_full)
        record["compiled_here"] = False
    else:
        # lr, momentum and damping are arguments of the compiled step:
        # one optimizer serves every grid point and seed of a task.
        optimizer = kfac_jax.Optimizer(
            value_and_grad_func=jax.value_and_grad(model.loss),
            l2_reg=0.0,
            use_adaptive_learning_rate=False,
            use_adaptive_momentum=False,
            use_adaptive_damping=False,
            curvature_ema=CURVATURE_EMA,
            inverse_update_period=INVERSE_UPDATE_PERIOD,
            num_burnin_steps=BURNIN_STEPS,
            multi_device=False,
        )
        # Compilation (tracing, graph matching, XLA): the first calls less
        # the same calls once compiled.
        cold = time.perf_counter()
        state = optimizer.init(jparams, init_rng, x_full)
        jax.block_until_ready(state)
        warm_steps(state)
        cold = time.perf_counter() - cold
        warm = time.perf_counter()
        warm_steps(state)
        compile_seconds = cold - (time.perf_counter() - warm)
        _COMPILED[name] = optimizer, compile_seconds
        record["compiled_here"] = True
    record["compile_seconds"] = compile_seconds

    params = jparams
    consumed = [0]  # batches drawn, burn-in included (data seen)

    def counted():
        for item in batches():
            consumed[0] += 1
            yield item

    data = counted()
    # The global batch counts after which the metric is measured.
    boundaries = [e * steps + b for e in range(budget) for b in check_after]
    pending, step, elapsed, checking = 0, 0, 0.0, 0.0
    epoch, epoch_loss, epoch_rows = 0, 0.0, 0  # the loss as Keras logs it
    try:
        while pending < len(boundaries):
            rng, key = jax.random.split(rng)
            tick = time.perf_counter()
            if step == 0:  # draws the burn-in batches, then its own
                feed = dict(data_iterator=data)
            else:
                feed = dict(batch=next(data))
            params, state, stats = optimizer.step(
                params, state, key, global_step_int=step, **feed, **hyper
            )
            loss = float(stats["loss"])  # waits for the step
            jax.block_until_ready(params)
            elapsed += time.perf_counter() - tick
            step += 1
            if (consumed[0] - 1) // steps != epoch:
                epoch, epoch_loss, epoch_rows = epoch + 1, 0.0, 0
            rows = int(stats["batch_size"])
            epoch_loss += loss * rows
            epoch_rows += rows
            if not math.isfinite(loss):
                record["diverged"] = True
                break
            # The checks this step crossed; during the burn-in (the first
            # call) the weights were the initial ones.
            while pending < len(boundaries):
                at = boundaries[pending]
                if at > consumed[0]:
                    break
                pending += 1
                if step == 1 and at <= BURNIN_STEPS:
                    value = metric0
                elif not all(
                    bool(jnp.all(jnp.isfinite(p)))
                    for p in jax.tree.leaves(params)
                ):
                    record["diverged"] = True
                    break
                else:
                    tock = time.perf_counter()
                    value = model.metric(params, x_eval, y_eval)
                    checking += time.perf_counter() - tock
                record["epochs"].append(at / steps)
                record["seconds"].append(elapsed)
                record["losses"].append(epoch_loss / max(epoch_rows, 1))
                record["metrics"].append(value)
            if record["diverged"] or (
                record["metrics"]
                and outcomes.reaches(
                    record["metrics"][-1], target, meta["higher_is_better"]
                )
            ):
                break
    except Exception as error:  # noqa: BLE001  (a failed point: recorded)
        import traceback

        traceback.print_exc()
        record["error"] = f"{type(error).__name__}: {error}"
    record["steps"] = step
    record["batches"] = consumed[0]
    record["epochs_done"] = consumed[0] / steps
    record["train_seconds"] = elapsed
    record["check_seconds"] = checking
    got = _reached(meta, record)
    record["to_target"] = (
        dict(
            epochs=got[0],
            seconds=got[1],
            seconds_with_compile=got[1] + record["compile_seconds"],
        )
        if got
        else None
    )
    record["wall_seconds"] = time.perf_counter() - start
    return record


# ---------------------------------------------------------------------------
# Tables, files and the command line


HEADER = (
    f"{'task':<12} {'seed':>4} {'damping':>8} {'lr':>8} {'epochs':>7} "
    f"{'s':>7} {'s+compile':>9} {'compile':>7} {'s/epoch':>7} "
    f"{'best':>9} {'last':>9}  note"
)


def row(meta, record):
    got = record["to_target"] or {}
    values = [m for m in record["metrics"] if math.isfinite(m)]
    best = outcomes.best_metric(values, meta["higher_is_better"])
    done = record["epochs_done"]
    per_epoch = record["train_seconds"] / done if done else None
    note = ""
    if record["error"]:
        note = f"failed: {record['error']}"
    elif record["diverged"]:
        note = "diverged"
    elif record["target"] is None:
        note = "no stored target"
    elif not got:
        note = "target not reached"
    return (
        f"{record['task']:<12} {record['seed']:>4} "
        f"{record['point']['damping']:>8g} {record['point']['lr']:>8g} "
        f"{fmt(got.get('epochs')):>7} {fmt(got.get('seconds')):>7} "
        f"{fmt(got.get('seconds_with_compile')):>9} "
        f"{fmt(record['compile_seconds']):>7} {fmt(per_epoch):>7} "
        f"{fmt(best, 4):>9} "
        f"{fmt(values[-1] if values else None, 4):>9}  {note}"
    )


def _meta(name):
    return json.loads(str(np.load(_paths(name, 0)[0])["meta"]))


def _one(name, seed, point, epochs, stop, log):
    meta = _meta(name)
    record = run(name, seed, point["damping"], point["lr"], epochs, stop)
    say(row(meta, record))
    if log:
        for e, s, loss, m in zip(
            record["epochs"],
            record["seconds"],
            record["losses"],
            record["metrics"],
        ):
            say(
                f"    epoch {e:5.2f}  {s:7.2f} s  loss {loss:9.4f}  "
                f"{meta['metric']} {m:.5g}"
            )
    return meta, record


def _parser():
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--export", action="store_true")
    mode.add_argument(
        "--run", action="store_true", help="the points --damping x --lr"
    )
    mode.add_argument("--grid", action="store_true")
    mode.add_argument("--report", action="store_true")
    mode.add_argument("--thor", action="store_true")
    parser.add_argument("--tasks", nargs="+", default=list(TASK_NAMES))
    parser.add_argument("--seeds", nargs="+", type=int, default=None)
    parser.add_argument(
        "--damping", nargs="+", type=float, default=[1.0], help="--run"
    )
    parser.add_argument(
        "--lr", nargs="+", type=float, default=[0.01], help="--run"
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="budget (default the task's)"
    )
    parser.add_argument(
        "--no-stop",
        action="store_true",
        help="--run: train the whole budget past the target",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: the middle grid point only, 2 epochs (unless "
        "--epochs), one report seed, files results/quick_kfac_jax_*",
    )
    return parser


def _points(args, path):
    """`--run`: every seed x damping x lr, each point's curve printed."""
    out = outcomes.read(path)
    for name in args.tasks:
        say(HEADER)
        out[name] = [
            _one(
                name,
                seed,
                dict(damping=damping, lr=lr),
                args.epochs,
                not args.no_stop,
                True,
            )[1]
            for seed in args.seeds or (TUNE_SEED,)
            for damping in args.damping
            for lr in args.lr
        ]
    outcomes.write(path, out)


def _grid(args, path):
    """`--grid`: the grid on the tune seed; each task's best point."""
    tuned = outcomes.read(path)
    for name in args.tasks:
        grid = GRIDS[name]
        if args.quick:
            grid = {
                k: v[len(v) // 2 : len(v) // 2 + 1] for k, v in grid.items()
            }
        say(HEADER)
        records = []
        for damping in grid["damping"]:
            for ratio in grid["ratio"]:
                point = dict(damping=damping, lr=damping * ratio)
                meta, record = _one(
                    name, TUNE_SEED, point, args.epochs, True, False
                )
                record["point"]["ratio"] = ratio
                records.append(record)
        best = outcomes.select(
            records, meta["target"], meta["higher_is_better"]
        )
        say(f"[{name}] best point on seed {TUNE_SEED}: {best}")
        tuned[name] = dict(
            best=best,
            grid=grid,
            target=meta["target"],
            runs=records,
            written=time.strftime("%Y-%m-%d %H:%M:%S"),
        )
        outcomes.write(path, tuned)


def _medians(point, tuned, records):
    """The report's summary of one task: the medians over its seeds."""
    got = [r["to_target"] or {} for r in records]

    def median(key):
        return outcomes.median([g.get(key, math.inf) for g in got])

    return dict(
        point=point,
        reached_on_tune_seed=tuned["best"]["reached"],
        median_epochs=median("epochs"),
        median_seconds=median("seconds"),
        median_seconds_with_compile=median("seconds_with_compile"),
        median_compile_seconds=outcomes.median(
            [r["compile_seconds"] for r in records]
        ),
    )


def _report(args, grid_path, path):
    """`--report`: each task's best grid point on the report seeds."""
    reported = outcomes.read(path)
    for name in args.tasks:
        tuned = outcomes.read(grid_path).get(name)
        if not tuned or not tuned["best"]["point"]:
            sys.exit(f"{name}: no grid result in {grid_path}: run --grid")
        point = tuned["best"]["point"]
        say(HEADER)
        records = [
            _one(name, seed, point, args.epochs, True, False)[1]
            for seed in args.seeds or REPORT_SEEDS[: 1 if args.quick else 3]
        ]
        summary = _medians(point, tuned, records)
        say(f"[{name}] kfac-jax medians: {summary}")
        reported[name] = dict(summary, runs=records)
        outcomes.write(path, reported)


def main():
    args = _parser().parse_args()
    prefix = PREFIX
    if args.quick:
        prefix = PREFIX.with_name("quick_" + PREFIX.name)
        args.epochs = args.epochs or 2
    if args.export:
        export(args.tasks, args.seeds or SEEDS)
        return
    if args.thor:
        path = pathlib.Path(f"{prefix}_thor.json")
        out = thor(args.tasks, args.seeds or SEEDS)
        outcomes.write(path, {**outcomes.read(path), **out})
        say(f"wrote {path}")
        return
    import jax
    import kfac_jax

    say(
        f"jax {jax.__version__}, kfac-jax {kfac_jax.__version__}, "
        f"{os.cpu_count()} CPUs; momentum {MOMENTUM}, curvature EMA "
        f"{CURVATURE_EMA}, inverses every {INVERSE_UPDATE_PERIOD} steps, "
        f"{BURNIN_STEPS} burn-in batches (counted as data seen)"
    )
    grid_path = pathlib.Path(f"{prefix}_grid.json")
    if args.run:
        path = pathlib.Path(f"{prefix}_run.json")
        _points(args, path)
    elif args.grid:
        path = grid_path
        _grid(args, path)
    else:
        path = pathlib.Path(f"{prefix}_report.json")
        _report(args, grid_path, path)
    say(f"wrote {path}")


if __name__ == "__main__":
    main()
