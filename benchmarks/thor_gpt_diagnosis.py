"""THOR on task (f)'s GPT: the damping against each factor's scale, and
short runs beside nanoGPT's AdamW (issue 37's diagnosis).

`--part scales`: `THOR.recommended()` for 50 steps, then per block the
mean eigenvalues `tr(A)/d_A`, `tr(G)/d_G` of the averaged factors and the
damping against their geometric mean, `√λ / √(tr(A)/d_A · tr(G)/d_G)`
(what π's split adds to each factor, relative to it); "per example" is
what the factors were when THOR scaled output gradients by the examples
`N` instead of the loss terms `N·L` (`G` `L²` smaller).

`--part runs`: the validation loss every `--every` steps of nanoGPT's
AdamW, `THOR.recommended()`, and THOR with the tied table first-order
(a `ReversibleEmbedding` subclass that overrides `call`), on the same
windows (seed 0, one process, in turn); with `--thor-options`, instead
`THOR.recommended(**options)` for each JSON dict given, after the preset.

    KERAS_BACKEND=jax python benchmarks/thor_gpt_diagnosis.py --part scales
    KERAS_BACKEND=jax python benchmarks/thor_gpt_diagnosis.py --part runs \\
        --steps 1000
    KERAS_BACKEND=jax python benchmarks/thor_gpt_diagnosis.py --part runs \\
        --steps 500 --thor-options '{"statistics_rows": 3}' \\
        '{"statistics_frequency": 5}' '{"kl_clip": null}'
"""

import argparse
import json
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import gpt  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import shakespeare  # noqa: E402
import tasks  # noqa: E402
from outcomes import say  # noqa: E402

import keras_thor  # noqa: E402

BATCH = 12


@keras.saving.register_keras_serializable(package="keras_thor_benchmarks")
class FirstOrderTable(keras.layers.ReversibleEmbedding):
    """A ReversibleEmbedding that overrides `call`: THOR leaves it
    first-order (as it did every ReversibleEmbedding before issue 37)."""

    def call(self, inputs, reverse=False):
        return super().call(inputs, reverse=reverse)


def _model(vocabulary, first_order_table=False):
    table = FirstOrderTable if first_order_table else None
    return gpt.gpt(
        vocabulary,
        seed=0,
        table_class=table or keras.layers.ReversibleEmbedding,
    )


class ValidationCurve(keras.callbacks.Callback):
    """The validation loss and the training seconds every `every` steps."""

    def __init__(self, x_valid, y_valid, every):
        super().__init__()
        self.x_valid, self.y_valid, self.every = x_valid, y_valid, every
        self.losses, self.seconds, self.clock = [], [], 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.clock += time.perf_counter() - self.start
        if (batch + 1) % self.every == 0:
            self.seconds.append(self.clock)
            self.losses.append(
                tasks.validation_loss(self.model, self.x_valid, self.y_valid)
            )


def _windows(text, steps):
    rng = np.random.default_rng(0)
    return text.training_windows(rng, steps * BATCH, gpt.CONTEXT)


def _mean_eigenvalue(blocks):
    blocks = np.asarray(blocks, dtype=np.float64)
    if blocks.ndim == 1:  # a diagonal factor
        return float(blocks.mean())
    return float(sum(np.trace(b) for b in blocks)) / (
        blocks.shape[0] * blocks.shape[-1]
    )


def scales(text):
    x, y = _windows(text, 50)
    model = keras_thor.convert_to_thor_model(_model(len(text.vocabulary)))
    thor = keras_thor.optimizers.THOR.recommended(batch_size=BATCH)
    model.compile(optimizer=thor, loss=gpt.LOSS)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    root = float(np.sqrt(thor.RECOMMENDED["damping"]))
    positions = gpt.CONTEXT**2
    say(f"√λ = {root:.4f}; per example, G was L² = {positions} smaller")
    say(
        f"{'block':<34} {'tr(A)/d':>9} {'tr(G)/d':>9} {'√λ/√(AG)':>9} "
        f"{'per example':>12}"
    )
    attention = model.get_layer("block_0_attention")
    kernels = [
        ("token table (tied)", model.get_layer("token_embedding").embeddings),
        ("position table", model.get_layer("position_embedding").embeddings),
        ("block 0 query", attention._query_dense.kernel),
        ("block 0 value", attention._value_dense.kernel),
        ("block 0 attention output", attention._output_dense.kernel),
        ("block 0 mlp in", model.get_layer("block_0_mlp_in").kernel),
        ("block 3 mlp out", model.get_layer("block_3_mlp_out").kernel),
    ]
    for name, kernel in kernels:
        state = thor.state_for(kernel)
        a = _mean_eigenvalue(state.a_factor)
        g = _mean_eigenvalue(state.g_factor)
        ratio = root / np.sqrt(a * g)
        say(
            f"{name:<34} {a:>9.3g} {g:>9.3g} {ratio:>9.3g} "
            f"{ratio * gpt.CONTEXT:>12.3g}"
        )


def _thor(vocabulary, first_order_table=False, **options):
    return (
        lambda: keras_thor.convert_to_thor_model(
            _model(vocabulary, first_order_table)
        ),
        lambda: keras_thor.optimizers.THOR.recommended(
            batch_size=BATCH, **options
        ),
    )


def runs(text, steps, every, thor_options=None):
    x, y = _windows(text, steps)
    x_valid, y_valid = text.validation_windows(gpt.CONTEXT)
    vocabulary = len(text.vocabulary)
    if thor_options:
        settings = {"THOR.recommended()": _thor(vocabulary)}
        for options in thor_options:
            settings[f"THOR.recommended(**{options})"] = _thor(
                vocabulary, **options
            )
        return _run_settings(settings, x, y, x_valid, y_valid, every)
    settings = {
        "AdamW (nanoGPT)": (lambda: _model(vocabulary), gpt.nanogpt_adamw),
        "THOR.recommended()": _thor(vocabulary),
        "THOR, table first-order": _thor(vocabulary, first_order_table=True),
    }
    _run_settings(settings, x, y, x_valid, y_valid, every)


def _run_settings(settings, x, y, x_valid, y_valid, every):
    for name, (build, make) in settings.items():
        model = build()
        model.compile(optimizer=make(), loss=gpt.LOSS)
        curve = ValidationCurve(x_valid, y_valid, every)
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[curve],
        )
        tasks.release(model)
        points = ", ".join(
            f"{(i + 1) * every}: {loss:.3f} ({s:.0f} s)"
            for i, (loss, s) in enumerate(zip(curve.losses, curve.seconds))
        )
        say(f"{name:<26} {points}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("scales", "runs"), required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument(
        "--thor-options",
        nargs="+",
        type=json.loads,
        help="JSON dicts of THOR.recommended() options, one run each",
    )
    args = parser.parse_args()
    text = shakespeare.load()
    say(f"keras {keras.__version__}, backend {keras.backend.backend()}")
    if args.part == "scales":
        scales(text)
    else:
        runs(text, args.steps, args.every, args.thor_options)


if __name__ == "__main__":
    main()
