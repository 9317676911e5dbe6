"""Task (f)'s model and nanoGPT's AdamW: a character-level GPT in Keras.

The model is nanoGPT's CPU configuration (`config/train_shakespeare_char.py`
with its README's CPU overrides): 4 pre-LayerNorm blocks of 4 heads,
width 128, context 64, no dropout, no biases (LayerNorm with a scale
only), GELU feed-forward of width 512, learned position embeddings and
the vocabulary head tied to the token embedding
(`keras.layers.ReversibleEmbedding`). nanoGPT's initialization: normal
with standard deviation 0.02, the residual projections (attention's
output, the feed-forward's second layer) 0.02 / √(2 · blocks).

nanoGPT's AdamW (`nanogpt_adamw`): rate 1e-3, 100 linear warm-up steps,
cosine to 1e-4 at step 2,000 (then constant), betas 0.9 / 0.99, weight
decay 0.1 on every weight with two or more axes (embeddings and the
attention's 3-axis kernels included; LayerNorm scales excluded), global
gradient clipping at norm 1.0, epsilon 1e-8 (torch's default).

Notation:
    - `blocks`, `heads`, `width`, `context`: the transformer's sizes.
"""

import math

import keras
import tasks
from keras import ops

BLOCKS = 4
HEADS = 4
WIDTH = 128
CONTEXT = 64
FEED_FORWARD = 4 * WIDTH
INIT_STD = 0.02
LAYER_NORM_EPSILON = 1e-5

# nanoGPT's train_shakespeare_char.py: its schedule and AdamW.
NANOGPT_RATE = 1e-3
NANOGPT_BATCH = 12  # sequences a step
NANOGPT_WARMUP_STEPS = 100
NANOGPT_DECAY_STEPS = 2000
NANOGPT_MIN_RATE = 1e-4
NANOGPT_BETAS = (0.9, 0.99)
NANOGPT_WEIGHT_DECAY = 0.1
NANOGPT_CLIP_NORM = 1.0
NANOGPT_EPSILON = 1e-8  # torch's AdamW default


def _normal(std):
    return keras.initializers.RandomNormal(stddev=std)


def _block(x, index, residual_std):
    name = f"block_{index}"
    h = keras.layers.LayerNormalization(
        epsilon=LAYER_NORM_EPSILON, center=False, name=f"{name}_ln_1"
    )(x)
    h = keras.layers.MultiHeadAttention(
        HEADS,
        WIDTH // HEADS,
        use_bias=False,
        kernel_initializer=_normal(INIT_STD),
        name=f"{name}_attention",
    )(h, h, use_causal_mask=True)
    # MultiHeadAttention gives all four projections one initializer; the
    # output projection takes nanoGPT's residual scale once built.
    x = keras.layers.Add(name=f"{name}_attention_residual")([x, h])
    h = keras.layers.LayerNormalization(
        epsilon=LAYER_NORM_EPSILON, center=False, name=f"{name}_ln_2"
    )(x)
    h = keras.layers.Dense(
        FEED_FORWARD,
        activation="gelu",  # exact, as torch's nn.GELU()
        use_bias=False,
        kernel_initializer=_normal(INIT_STD),
        name=f"{name}_mlp_in",
    )(h)
    h = keras.layers.Dense(
        WIDTH,
        use_bias=False,
        kernel_initializer=_normal(residual_std),
        name=f"{name}_mlp_out",
    )(h)
    return keras.layers.Add(name=f"{name}_mlp_residual")([x, h])


def gpt(
    vocabulary_size,
    blocks=BLOCKS,
    seed=None,
    table_class=keras.layers.ReversibleEmbedding,
):
    """nanoGPT's CPU GPT over `vocabulary_size` characters.

    Inputs `(B, L)` int32 ids with `L ≤ CONTEXT`; outputs `(B, L,
    vocabulary_size)` logits. `seed` seeds the initial weights (else
    Keras's global seed); `table_class` is the tied table's class.
    """
    if seed is not None:
        keras.utils.set_random_seed(seed)
    residual_std = INIT_STD / math.sqrt(2 * blocks)
    token_ids = keras.Input((None,), dtype="int32", name="token_ids")
    token_embedding = table_class(
        vocabulary_size,
        WIDTH,
        tie_weights=True,
        embeddings_initializer=_normal(INIT_STD),
        name="token_embedding",
    )
    x = token_embedding(token_ids)
    positions = keras.layers.Embedding(
        CONTEXT,
        WIDTH,
        embeddings_initializer=_normal(INIT_STD),
        name="position_embedding",
    )(tasks.Positions(name="position_ids")(token_ids))
    x = keras.layers.Add(name="embeddings")([x, positions])
    for index in range(blocks):
        x = _block(x, index, residual_std)
    x = keras.layers.LayerNormalization(
        epsilon=LAYER_NORM_EPSILON, center=False, name="ln_f"
    )(x)
    logits = token_embedding(x, reverse=True)
    model = keras.Model(token_ids, logits, name="gpt")
    for index in range(blocks):
        output = model.get_layer(f"block_{index}_attention")._output_dense
        output.kernel.assign(
            keras.random.normal(output.kernel.shape, stddev=residual_std)
        )
    return model


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class NanoGPTSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """nanoGPT's `get_lr`: linear warm-up `rate · (t + 1) / (warmup + 1)`
    for `t < warmup`, then cosine from `rate` to `min_rate` at
    `decay_steps`, then `min_rate`."""

    def __init__(
        self,
        rate=NANOGPT_RATE,
        warmup_steps=NANOGPT_WARMUP_STEPS,
        decay_steps=NANOGPT_DECAY_STEPS,
        min_rate=NANOGPT_MIN_RATE,
    ):
        self.rate = rate
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.min_rate = min_rate

    def __call__(self, step):
        step = ops.cast(step, "float32")
        warmup = self.rate * (step + 1.0) / (self.warmup_steps + 1.0)
        progress = (step - self.warmup_steps) / (
            self.decay_steps - self.warmup_steps
        )
        progress = ops.clip(progress, 0.0, 1.0)
        cosine = 0.5 * (1.0 + ops.cos(math.pi * progress))
        decayed = self.min_rate + cosine * (self.rate - self.min_rate)
        return ops.where(step < self.warmup_steps, warmup, decayed)

    def get_config(self):
        return dict(
            rate=self.rate,
            warmup_steps=self.warmup_steps,
            decay_steps=self.decay_steps,
            min_rate=self.min_rate,
        )


def nanogpt_adamw(rate=NANOGPT_RATE, batch=NANOGPT_BATCH):
    """AdamW as nanoGPT trains task (f)'s model (the module docstring);
    `rate` the peak rate (the schedule's minimum stays `rate / 10`). No
    decay on LayerNormalization scales and offsets and on biases, nanoGPT's
    "every weight with fewer than two axes" for Keras's layers. At another
    `batch` the warm-up and decay lengths keep their sequences: steps
    times `NANOGPT_BATCH / batch`."""
    scale = NANOGPT_BATCH / batch
    schedule = NanoGPTSchedule(
        rate,
        warmup_steps=round(NANOGPT_WARMUP_STEPS * scale),
        decay_steps=round(NANOGPT_DECAY_STEPS * scale),
        min_rate=rate * NANOGPT_MIN_RATE / NANOGPT_RATE,
    )
    optimizer = keras.optimizers.AdamW(
        schedule,
        beta_1=NANOGPT_BETAS[0],
        beta_2=NANOGPT_BETAS[1],
        weight_decay=NANOGPT_WEIGHT_DECAY,
        epsilon=NANOGPT_EPSILON,
        global_clipnorm=NANOGPT_CLIP_NORM,
    )
    optimizer.exclude_from_weight_decay(var_names=["gamma", "beta", "bias"])
    return optimizer


def generate(model, prompt_ids, length, seed, temperature=1.0):
    """`length` characters sampled after `prompt_ids` (a 1-D sequence),
    the model seeing the last `CONTEXT`; the sampled ids.

    The window is always `CONTEXT` long (padded on the right, which a
    causal model does not see from earlier positions): one input shape
    for every call."""
    generator = keras.random.SeedGenerator(seed)
    ids = list(prompt_ids)
    for _ in range(length):
        window = ids[-CONTEXT:]
        padded = window + [0] * (CONTEXT - len(window))
        logits = model(
            ops.convert_to_tensor([padded], dtype="int32"), training=False
        )
        logits = logits[:, len(window) - 1] / temperature
        ids.append(
            int(
                ops.convert_to_numpy(
                    keras.random.categorical(logits, 1, seed=generator)
                )[0, 0]
            )
        )
    return ids[len(prompt_ids) :]
