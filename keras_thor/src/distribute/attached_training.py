"""keras_thor's training attached to a model instance, its class unchanged.

`convert_to_thor_model` and the boost functions (`to_boost_model`,
`LessBN`, `AutoBoost`) give the model object itself methods of its own,
which shadow its class's (Python finds an instance's attribute before its
class's method). Each feature is an `AttachedTraining`: its `compile`
check, the train function it makes when the compiled optimizer is its
own, what it adds to the saved configs and what it reads once `fit`
returns. The instance's methods run the attached features' hooks around
the class's own: `compile`, `make_train_function` (the first feature that
owns the optimizer makes it, else the class), `fit` (a keras-hub Task's
maps its preprocessor), `get_compile_config` and `get_build_config`. As
keras_thor's model classes, the instance also gets Keras's steps mended
for tf.distribute (`distributed_trainer`), for every optimizer:
`make_test_function`, `_maybe_symbolic_build`, and `train_step` and
`test_step` where its class does not override them. Everything else
(`call`, `generate`, `get_config`, saving) stays the class's. `detach`
removes a feature, and the methods with the last one.
"""

import types

import keras

from keras_thor.src.distribute import distributed_trainer

_FEATURES = "_keras_thor_attached_trainings"


class AttachedTraining:
    """One feature's hooks; the base class's hooks do nothing.

    Args:
        name: The feature's key in the saved build config (`"thor"`,
            `"boost"`).
    """

    def __init__(self, name):
        self.name = name

    def check_compile(self, model, optimizer):
        """Raises where `compile(optimizer=optimizer)` cannot train."""

    def after_compile(self, model):
        """Runs after the class's `compile`."""

    def train_function(self, model, force):
        """The feature's train function for `model`, or `None` where the
        compiled optimizer is not the feature's."""
        return None

    def compile_config(self, model, config):
        """`model.get_compile_config()`, as the feature saves it."""
        return config

    def build_config(self, model):
        """What the feature records in the saved build config (under its
        `name`, read back by `keras_thor.load_model`), or `None`."""
        return None

    def after_fit(self, model):
        """Runs once the class's `fit` returns."""


def features(model):
    """The features attached to `model`, in the order of attachment."""
    return list(model.__dict__.get(_FEATURES, ()))


def is_attached(model, feature):
    """Whether `feature` is attached to `model`."""
    return feature in features(model)


def _class_method(model, name):
    """`model`'s class's method `name`, bound to `model`."""
    return types.MethodType(getattr(type(model), name), model)


def _compile(model, *args, **kwargs):
    # The class's own defaults stay (a keras-hub Task's `optimizer="auto"`).
    optimizer = args[0] if args else kwargs.get("optimizer")
    for feature in features(model):
        feature.check_compile(model, optimizer)
    result = type(model).compile(model, *args, **kwargs)
    for feature in features(model):
        feature.after_compile(model)
    return result


def _make_train_function(model, force=False):
    distributed_trainer.check_jit_under_strategy(model)
    for feature in features(model):
        function = feature.train_function(model, force)
        if function is not None:
            return function
    return _class_method(model, "make_train_function")(force=force)


def _make_test_function(model, force=False):
    distributed_trainer.check_jit_under_strategy(model)
    return _class_method(model, "make_test_function")(force=force)


def _maybe_symbolic_build(model, iterator=None, data_batch=None):
    distributed_trainer.mended_symbolic_build(
        model,
        _class_method(model, "_maybe_symbolic_build"),
        iterator,
        data_batch,
    )


def _train_step(model, *args):
    return distributed_trainer.mended_train_step(
        model, _class_method(model, "train_step"), *args
    )


def _test_step(model, *args):
    return distributed_trainer.mended_test_step(
        model, _class_method(model, "test_step"), *args
    )


def _fit(model, *args, **kwargs):
    history = type(model).fit(model, *args, **kwargs)
    for feature in features(model):
        feature.after_fit(model)
    return history


def _get_compile_config(model):
    config = _class_method(model, "get_compile_config")()
    for feature in features(model):
        config = feature.compile_config(model, config)
    return config


def _get_build_config(model):
    config = _class_method(model, "get_build_config")()
    recorded = {}
    for feature in features(model):
        record = feature.build_config(model)
        if record is not None:
            recorded[feature.name] = record
    if config is None or not recorded:
        return config
    # Keras's `build_from_config` reads its own keys only.
    return {**config, "keras_thor": recorded}


_METHODS = {
    "compile": _compile,
    "make_train_function": _make_train_function,
    "make_test_function": _make_test_function,
    "_maybe_symbolic_build": _maybe_symbolic_build,
    "fit": _fit,
    "get_compile_config": _get_compile_config,
    "get_build_config": _get_build_config,
}
# Attached only where the class keeps Keras's own step.
_STEPS = {"train_step": _train_step, "test_step": _test_step}


def attach(model, feature):
    """Gives `model` (this instance only) `feature` and the methods the
    module's docstring lists; attaching twice changes nothing."""
    if is_attached(model, feature):
        return
    methods = dict(_METHODS)
    for name, method in _STEPS.items():
        if getattr(type(model), name) is getattr(keras.Model, name):
            methods[name] = method
    for name, method in methods.items():
        object.__setattr__(model, name, types.MethodType(method, model))
    object.__setattr__(model, _FEATURES, (*features(model), feature))
    model.train_function = None


def detach(model, feature):
    """Takes `feature` off `model`, and the methods with the last feature;
    a train function it holds is dropped."""
    if not is_attached(model, feature):
        return
    remaining = tuple(f for f in features(model) if f is not feature)
    if remaining:
        object.__setattr__(model, _FEATURES, remaining)
    else:
        for name in (*_METHODS, *_STEPS, _FEATURES):
            model.__dict__.pop(name, None)
    model.train_function = None
