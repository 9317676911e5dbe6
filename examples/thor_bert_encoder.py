"""THOR on a small BERT-style encoder, with MindSpore's BERT recipe.

A two-block post-LayerNorm transformer encoder (token and position
embeddings, attention whose query/key/value/output projections are plain
`keras.layers.Dense` layers, a feed-forward block, a [CLS] pooler and a
classification head) on a synthetic task that needs attention and
positions: every sequence holds one marker `A` and one marker `B` among
random filler tokens, and the label says whether `A` comes first. Token
counts are the same in both classes, so a bag of words is at chance.

`keras_thor.convert_to_thor_model` gives the Dense, Embedding and
LayerNormalization layers their curvature rules (as MindSpore's BERT THOR
preconditions every Dense and Embedding and applies its diagonal rule to
LayerNorm); THOR then trains with the shape of MindSpore's BERT-large THOR
recipe: polynomial learning-rate and damping decay
(`bert_thor_learning_rate`, `bert_thor_damping`, powers 2 and 4),
momentum 0.9, weight decay off for LayerNorm and biases, per-tensor
gradient clipping. Keras AdamW trains the same model (same initial
weights, data and seed) for comparison. Prints a table.

    python examples/thor_bert_encoder.py [--epochs 6] [--batch-size 32]
        [--frequency 25] [--seed 0]

The data is generated with a seeded NumPy RNG: nothing is downloaded. Both
runs take about 30 seconds on two CPU threads.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # THOR trains on TF

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402

import keras_thor  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(2)
tf.config.threading.set_inter_op_parallelism_threads(2)

VOCAB = 32  # 0: [CLS], 1: marker A, 2: marker B, 3..31: filler
CLS, MARK_A, MARK_B = 0, 1, 2
LENGTH = 24  # tokens after [CLS]
WIDTH = 32
HEADS = 4
BLOCKS = 2
TRAIN, TEST = 4000, 1000

# MindSpore's BERT-large THOR recipe (pretrain_config_Ascend_Thor.yaml):
# lr 0.006464 -> 1e-6 with power 2, damping 0.007035 -> 1e-6 with power 4,
# momentum 0.9, weight decay 1e-5 off LayerNorm and biases, frequency 100.
# It stops after 2,500 of its 30,000 decay steps; here the decay spans the
# run. The rate is THOR's; the recipe's 6.5e-3 is for BERT-large.
THOR_LR = 0.02
LR_END = 1e-6
LR_POWER = 2.0
DAMPING_INIT = 0.007035
DAMPING_END = 1e-6
DAMPING_POWER = 4.0
MOMENTUM = 0.9
WEIGHT_DECAY = 1e-5
ADAMW_LR = 2e-3


def sequences(count, rng):
    """`count` sequences ([CLS] + LENGTH tokens) and their labels."""
    tokens = rng.integers(3, VOCAB, size=(count, LENGTH))
    for row in tokens:
        first, second = rng.choice(LENGTH, size=2, replace=False)
        row[first], row[second] = MARK_A, MARK_B
    labels = np.argmax(tokens == MARK_A, axis=1) < np.argmax(
        tokens == MARK_B, axis=1
    )
    cls = np.full((count, 1), CLS)
    return np.concatenate([cls, tokens], axis=1), labels.astype("int32")


def data(seed):
    rng = np.random.default_rng(seed)
    return sequences(TRAIN, rng) + sequences(TEST, rng)


@keras.saving.register_keras_serializable(package="examples")
class Positions(keras.layers.Layer):
    """The position ids `0..L-1` of a batch of token ids, as `(B, L)`."""

    def call(self, token_ids):
        length = ops.shape(token_ids)[1]
        return ops.broadcast_to(
            ops.arange(length, dtype="int32")[None], ops.shape(token_ids)
        )


@keras.saving.register_keras_serializable(package="examples")
class ScaledDotProductAttention(keras.layers.Layer):
    """Multi-head softmax attention of projected `[query, key, value]`.

    No weights: the projections are the Dense layers around it, which THOR
    preconditions (`keras.layers.MultiHeadAttention` projects with
    `EinsumDense`, which THOR does not precondition).
    """

    def __init__(self, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads

    def _split(self, x):
        batch, length, width = ops.shape(x)
        x = ops.reshape(
            x, (batch, length, self.num_heads, width // self.num_heads)
        )
        return ops.transpose(x, (0, 2, 1, 3))

    def call(self, inputs):
        query, key, value = (self._split(x) for x in inputs)
        depth = ops.cast(ops.shape(query)[-1], query.dtype)
        scores = ops.matmul(query, ops.transpose(key, (0, 1, 3, 2)))
        weights = ops.softmax(scores / ops.sqrt(depth), axis=-1)
        context = ops.transpose(ops.matmul(weights, value), (0, 2, 1, 3))
        batch, length = ops.shape(context)[0], ops.shape(context)[1]
        return ops.reshape(context, (batch, length, -1))

    def compute_output_shape(self, input_shapes):
        return input_shapes[2]

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads}


@keras.saving.register_keras_serializable(package="examples")
class FirstToken(keras.layers.Layer):
    """The [CLS] vector: `x[:, 0]`."""

    def call(self, x):
        return x[:, 0]

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[2])


def encoder_block(x, index):
    name = f"block{index}"
    query = keras.layers.Dense(WIDTH, name=f"{name}_query")(x)
    key = keras.layers.Dense(WIDTH, name=f"{name}_key")(x)
    value = keras.layers.Dense(WIDTH, name=f"{name}_value")(x)
    context = ScaledDotProductAttention(HEADS, name=f"{name}_attention")(
        [query, key, value]
    )
    context = keras.layers.Dense(WIDTH, name=f"{name}_attention_output")(
        context
    )
    x = keras.layers.Add()([x, context])
    x = keras.layers.LayerNormalization(name=f"{name}_attention_layer_norm")(x)
    hidden = keras.layers.Dense(4 * WIDTH, "gelu", name=f"{name}_ffn_in")(x)
    hidden = keras.layers.Dense(WIDTH, name=f"{name}_ffn_out")(hidden)
    x = keras.layers.Add()([x, hidden])
    return keras.layers.LayerNormalization(name=f"{name}_ffn_layer_norm")(x)


def encoder(seed):
    keras.utils.set_random_seed(seed)
    token_ids = keras.Input((LENGTH + 1,), dtype="int32", name="token_ids")
    tokens = keras.layers.Embedding(VOCAB, WIDTH, name="token_embedding")(
        token_ids
    )
    positions = keras.layers.Embedding(
        LENGTH + 1, WIDTH, name="position_embedding"
    )(Positions(name="positions")(token_ids))
    x = keras.layers.Add()([tokens, positions])
    x = keras.layers.LayerNormalization(name="embeddings_layer_norm")(x)
    for index in range(BLOCKS):
        x = encoder_block(x, index)
    pooled = keras.layers.Dense(WIDTH, "tanh", name="pooler")(
        FirstToken(name="cls")(x)
    )
    logits = keras.layers.Dense(2, name="classifier")(pooled)
    return keras.Model(token_ids, logits, name="tiny_bert")


def no_decay_for_layer_norm_and_bias(variable):
    """MindSpore's BERT `decay_filter` ('layernorm', 'bias' excluded)."""
    return "layer_norm" not in variable.path and variable.name != "bias"


def poly_learning_rate(initial, total_steps):
    """MindSpore's BERT poly decay (`get_bert_thor_lr`), over the run."""
    return keras_thor.schedules.bert_thor_learning_rate(
        initial_learning_rate=initial,
        end_learning_rate=LR_END,
        power=LR_POWER,
        decay_steps=total_steps,
    )


def thor(total_steps, args):
    return keras_thor.optimizers.THOR(
        poly_learning_rate(THOR_LR, total_steps),
        damping=keras_thor.schedules.bert_thor_damping(
            initial_damping=DAMPING_INIT,
            end_damping=DAMPING_END,
            power=DAMPING_POWER,
            decay_steps=total_steps,
        ),
        momentum=MOMENTUM,
        weight_decay=WEIGHT_DECAY,
        batch_size=args.batch_size,  # N of the LayerNorm rule
        decay_filter=no_decay_for_layer_norm_and_bias,
        enable_clip_grad=True,
        frequency=args.frequency,
    )


def adamw(total_steps):
    optimizer = keras.optimizers.AdamW(
        poly_learning_rate(ADAMW_LR, total_steps),
        weight_decay=0.01,
    )
    # Keras matches `var_names` against `variable.name`: LayerNorm's are
    # gamma and beta.
    optimizer.exclude_from_weight_decay(var_names=["gamma", "beta", "bias"])
    return optimizer


def train(name, model, optimizer, data, args):
    x_train, y_train, x_test, y_test = data
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    keras.utils.set_random_seed(args.seed)  # the same shuffling for both
    start = time.perf_counter()
    history = model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=(x_test, y_test),
        verbose=0,
    )
    seconds = time.perf_counter() - start
    return {
        "name": name,
        "troubles": getattr(optimizer, "curvature_troubles", None),
        "loss": history.history["loss"][-1],
        "accuracy": history.history["val_accuracy"],
        "seconds": seconds,
        "epochs": args.epochs,
    }


def print_table(results, args, steps_per_epoch):
    print(
        f"A-before-B, tiny BERT ({BLOCKS} blocks, width {WIDTH}, {HEADS} "
        f"heads), batch {args.batch_size}, {steps_per_epoch} steps/epoch, "
        f"THOR frequency {args.frequency}, seed {args.seed}"
    )
    header = (
        f"{'optimizer':<16} {'train loss':>10} {'test acc':>9} "
        f"{'seconds':>8} {'epochs':>7}  test acc per epoch"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        curve = " ".join(f"{a:.2f}" for a in r["accuracy"])
        print(
            f"{r['name']:<16} {r['loss']:>10.4f} {r['accuracy'][-1]:>9.4f} "
            f"{r['seconds']:>8.1f} {r['epochs']:>7}  {curve}"
        )
    for r in results:
        if r["troubles"] is not None:
            print(
                f"{r['name']}: {r['troubles']} layer refreshes fell back to "
                "a more damped inverse or kept the previous one"
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--frequency",
        type=int,
        default=25,
        help="THOR's curvature refresh interval in steps (MindSpore's BERT: "
        "100, 25 refreshes in its 2,500 steps)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if keras.backend.backend() != "tensorflow":
        parser.error("THOR trains on the TensorFlow backend only")
    steps_per_epoch = -(-TRAIN // args.batch_size)
    total_steps = steps_per_epoch * args.epochs
    base = encoder(args.seed)
    thor_model = keras_thor.convert_to_thor_model(base)  # base, in place
    adamw_model = keras.models.clone_model(base)
    adamw_model.set_weights(base.get_weights())
    dataset = data(args.seed)
    results = [
        train("THOR", thor_model, thor(total_steps, args), dataset, args),
        train("keras AdamW", adamw_model, adamw(total_steps), dataset, args),
    ]
    print_table(results, args, steps_per_epoch)


if __name__ == "__main__":
    main()
