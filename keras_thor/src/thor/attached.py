"""THOR's training attached to a model instance, its class unchanged.

`convert_to_thor_model` gives the model object itself methods of its own,
which shadow its class's (Python finds an instance's attribute before its
class's method): `compile` checks that THOR can train here and then runs
the class's `compile`; `make_train_function` returns THOR's train function
when the model is compiled with THOR, else the class's; `fit` runs the
class's `fit` (a keras-hub Task's maps its preprocessor) and then reads
THOR's skipped updates. As keras_thor's model classes, the instance also
gets Keras's steps mended for tf.distribute (`distributed_trainer`), for
every optimizer: `make_test_function`, `_maybe_symbolic_build`, and
`train_step` and `test_step` where its class does not override them.
Everything else (`call`, `generate`, `get_config`, saving) stays the
class's. `detach_thor_training` removes them all.
"""

import types

import keras

from keras_thor.src.distribute import distributed_trainer
from keras_thor.src.thor import fit_hooks

_ATTACHED = "_keras_thor_attached_training"


def _compile(model, *args, **kwargs):
    # The class's own defaults stay (a keras-hub Task's `optimizer="auto"`).
    fit_hooks.check_compile(args[0] if args else kwargs.get("optimizer"))
    return type(model).compile(model, *args, **kwargs)


def _class_method(model, name):
    """`model`'s class's method `name`, bound to `model`."""
    return types.MethodType(getattr(type(model), name), model)


def _make_train_function(model, force=False):
    distributed_trainer.check_jit_under_strategy(model)
    return fit_hooks.make_train_function(
        model, force, _class_method(model, "make_train_function")
    )


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
    fit_hooks.after_fit(model)
    return history


_METHODS = {
    "compile": _compile,
    "make_train_function": _make_train_function,
    "make_test_function": _make_test_function,
    "_maybe_symbolic_build": _maybe_symbolic_build,
    "fit": _fit,
}
# Attached only where the class keeps Keras's own step.
_STEPS = {"train_step": _train_step, "test_step": _test_step}


def has_thor_training(model):
    """Whether `attach_thor_training` gave `model` THOR's training."""
    return bool(model.__dict__.get(_ATTACHED, False))


def attach_thor_training(model):
    """Gives `model` (this instance only) the methods the module's
    docstring lists; attaching twice changes nothing."""
    methods = dict(_METHODS)
    for name, method in _STEPS.items():
        if getattr(type(model), name) is getattr(keras.Model, name):
            methods[name] = method
    for name, method in methods.items():
        object.__setattr__(model, name, types.MethodType(method, model))
    object.__setattr__(model, _ATTACHED, True)


def detach_thor_training(model):
    """Gives `model` back its class's methods, and drops a THOR train
    function it holds."""
    if not has_thor_training(model):
        return
    for name in (*_METHODS, *_STEPS, _ATTACHED):
        model.__dict__.pop(name, None)
    model.train_function = None
