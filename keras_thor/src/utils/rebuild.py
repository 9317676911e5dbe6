"""Rebuilding a Sequential or Functional model from its config.

`to_keras_model` serializes a `ThorSequential`/`ThorFunctional` (of
`ThorModel(inputs, outputs)` or of an earlier keras_thor's file), changes
its config (the model class, earlier versions' layer classes) and builds
the result with the original weights. Every other conversion is in place.
"""

import types

import keras

from keras_thor.src import keras_internals

# The config entries of Keras's own model classes.
KERAS_FUNCTIONAL = {
    "module": "keras.src.models.functional",
    "class_name": "Functional",
    "registered_name": "Functional",
}
KERAS_SEQUENTIAL = {
    "module": "keras",
    "class_name": "Sequential",
    "registered_name": None,
}


def check_rewritable(model, function, subclass_hint):
    """Raises unless `model` is a built Sequential or Functional model."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            "Argument `model` must be a `keras.Model`. "
            f"Received: model={model!r} (of type {type(model).__name__})"
        )
    if not keras_internals.is_functional(model):
        raise ValueError(
            f"`{function}` converts Sequential and Functional models. "
            f"For a subclassed model, {subclass_hint}. "
            f"Received: model of type {type(model).__name__}"
        )
    if not model.built:
        raise ValueError(
            "Argument `model` must be built (give it an input shape or call "
            f"it once) so that its weights can be kept. Received: {model.name}"
        )


def _copy_all_weights(source, target):
    target.set_weights(source.get_weights())


def _layers_of(model):
    """`model` and every layer inside it."""
    return [model, *keras_internals.sublayers(model, recursive=True)]


def _is_keras_object(obj):
    """Whether `obj` (a class or function) comes from Keras or keras_thor."""
    module = getattr(obj, "__module__", None) or ""
    return module.split(".")[0] in {"keras", "keras_thor"}


def _describe(layer):
    return f"layer '{layer.name}' ({type(layer).__name__})"


def _own_objects(model):
    """`{name: object}` for the classes and functions `model`'s layers use
    that Keras's deserializer looks up by name: every layer's class and the
    functions, initializers, regularizers and constraints its attributes
    hold. A name two different objects share maps to `None`."""
    found = {}

    def add(obj):
        if _is_keras_object(obj):
            return
        name = keras.saving.get_registered_name(obj)
        if found.setdefault(name, obj) is not obj:
            found[name] = None

    for layer in _layers_of(model):
        add(type(layer))
        for value in vars(layer).values():
            if isinstance(value, types.FunctionType):
                if value.__name__ != "<lambda>":
                    add(value)
            elif hasattr(value, "get_config") and not isinstance(
                value, (type, keras.layers.Layer, keras.Variable)
            ):
                add(type(value))
    return found


def _layer_configs(config, enclosing=None):
    """`(layer config, enclosing layer config)` for every config in
    `config` that names a class (`enclosing`: the nearest layer config
    around it, or itself)."""
    if isinstance(config, list):
        for item in config:
            yield from _layer_configs(item, enclosing)
        return
    if not isinstance(config, dict):
        return
    inner = config.get("config")
    if "class_name" in config and isinstance(inner, dict) and "name" in inner:
        enclosing = config
    if "class_name" in config:
        yield config, enclosing
    for value in config.values():
        yield from _layer_configs(value, enclosing)


def _needed_names(config):
    """`{name: enclosing layer config}` for the names of the classes and
    functions Keras looks up to deserialize `config`."""
    needed = {}
    for item, enclosing in _layer_configs(config):
        if item["class_name"] == "function":
            name = item.get("config")
        else:
            name = item.get("registered_name")
        if isinstance(name, str):
            needed.setdefault(name, enclosing)
    return needed


def _lambda_refusal(config, reason, fix):
    return ValueError(
        f"Cannot rebuild layer '{config['config'].get('name')}' (Lambda) "
        f"without unsafe deserialization: {reason}. {fix}"
    )


def _reuse_lambda_functions(serialized, model, scope):
    """Points every `Lambda` config at its layer's own `function` (through
    `scope`), so that Python lambdas and users' functions need neither
    registering nor unsafe deserialization; returns `{name: layer}` of the
    Lambdas whose callable `mask` is set back after deserialization."""
    by_name = {}
    for layer in _layers_of(model):
        if isinstance(layer, keras.layers.Lambda):
            by_name.setdefault(layer.name, []).append(layer)
    masked = {}
    for item, _ in list(_layer_configs(serialized)):
        inner = item.get("config")
        if item["class_name"] != "Lambda" or not isinstance(inner, dict):
            continue
        layers = by_name.get(inner.get("name"), [])
        if len(layers) > 1:
            raise _lambda_refusal(
                item,
                f"{len(layers)} Lambda layers of the model have this name",
                "Give each Lambda layer its own `name`.",
            )
        if not layers:
            continue
        name = f"keras_thor>rebuilt_function_{len(scope)}"
        scope[name] = layers[0].function
        inner["function"] = name
        if callable(layers[0].mask):
            inner["mask"] = None
            masked[layers[0].name] = layers[0]
        shape = inner.get("output_shape")
        if isinstance(shape, dict) and shape.get("class_name") == "__lambda__":
            raise _lambda_refusal(
                item,
                "its `output_shape` is a Python lambda",
                "Pass a shape tuple or a named function as `output_shape` "
                "(or leave it out: Keras infers the shape).",
            )
    return masked


def _refusal(layer, error):
    # Keras wraps the error of a layer's constructor in its own errors.
    while error.__cause__ or (
        error.__context__ and not error.__suppress_context__
    ):
        error = error.__cause__ or error.__context__
    reason = " ".join(str(error).split())
    if len(reason) > 200:  # Whole sentences, not Keras's config dumps.
        cut = reason[:200].rfind(". ")
        reason = reason[:cut] if cut > 0 else reason[:200] + "..."
    reason = reason.rstrip(".")
    return ValueError(
        f"Cannot rebuild {_describe(layer)} from its config: {reason}. "
        "Give its class a `get_config` that returns its constructor "
        "arguments (and a `from_config` if they are not plain values)."
    )


def _rebuild_alone(layer):
    """Rebuilds `layer` from its config; raises what that raises, or a
    `ValueError` if the copy's weights differ in shape."""
    copy = type(layer).from_config(layer.get_config())
    build_config = layer.get_build_config()
    if build_config:
        copy.build_from_config(build_config)
    shapes = [tuple(w.shape) for w in layer.weights]
    copy_shapes = [tuple(w.shape) for w in copy.weights]
    if copy_shapes != shapes:
        raise ValueError(
            f"the rebuilt layer's weights have shapes {copy_shapes}, "
            f"not {shapes}"
        )


def _refusal_for(model, attempt):
    """A one-line refusal naming the first of `model`'s own layers for
    which `attempt(layer)` raises, else `None`."""
    for layer in _layers_of(model)[1:]:
        if _is_keras_object(type(layer)):
            continue
        try:
            attempt(layer)
        except Exception as reason:
            return _refusal(layer, reason)
    return None


def _or_refusal(model, function, attempt):
    """`function()`; if it raises, a one-line refusal naming the first of
    `model`'s own layers for which `attempt(layer)` raises (else the
    error itself)."""
    try:
        return function()
    except Exception as error:
        failure = error
    # Outside the `except`, so that the attempts' errors are their own.
    refusal = _refusal_for(model, attempt)
    if refusal is None:
        raise failure
    raise refusal from failure


def _scope_for(model, serialized):
    """The custom objects `serialized` needs, from `model`'s own layers
    (and from an enclosing `keras.saving.custom_object_scope`)."""
    own = _own_objects(model)
    scope = {}
    for name, enclosing in _needed_names(serialized).items():
        known = keras.saving.get_registered_object(name)
        if known is not None:
            scope[name] = known
        elif own.get(name) is not None:
            scope[name] = own[name]
        elif name in own and enclosing is not None:
            layer_name = enclosing["config"]["name"]
            raise ValueError(
                f"Cannot rebuild layer '{layer_name}' "
                f"({enclosing['class_name']}): two different classes or "
                f"functions of the model are named '{name}'. Register them "
                "with `keras.saving.register_keras_serializable(package=...)` "
                "so that their names differ."
            )
    return scope


def rebuild(
    model,
    functional,
    sequential,
    rewrite=None,
    copy_weights=_copy_all_weights,
):
    """`model` rebuilt from its config as another model class.

    Users' unregistered layer classes (and the functions, initializers,
    regularizers and constraints their layers hold) are found on the
    model's own layers; `Lambda` layers keep their own function objects,
    so neither needs registering nor unsafe deserialization. A layer that
    cannot be rebuilt from its config raises a `ValueError` naming it.

    Args:
        model: A built Sequential or Functional model (checked by the
            caller with `check_rewritable`).
        functional, sequential: The config entries (`module`,
            `class_name`, `registered_name`) of the class the result takes
            for a Functional and for a Sequential `model`.
        rewrite: Optional `serialized -> serialized`, applied to the
            model's serialized config before the class is set.
        copy_weights: `(model, rebuilt) -> None`; by default every weight,
            in order.

    Returns:
        The rebuilt model, not compiled.
    """
    serialized = _or_refusal(
        model,
        lambda: keras.saving.serialize_keras_object(model),
        lambda layer: layer.get_config(),
    )
    if rewrite is not None:
        serialized = rewrite(serialized)
    serialized = dict(serialized)
    serialized.pop("compile_config", None)
    target = sequential if isinstance(model, keras.Sequential) else functional
    serialized.update(target)
    scope = {}
    masked = _reuse_lambda_functions(serialized, model, scope)
    scope.update(_scope_for(model, serialized))
    with keras.saving.custom_object_scope(scope):
        rebuilt = _or_refusal(
            model,
            lambda: keras.saving.deserialize_keras_object(serialized),
            _rebuild_alone,
        )
        rebuilt_layers = {layer.name: layer for layer in _layers_of(rebuilt)}
        for name, layer in masked.items():
            rebuilt_layers[name].mask = layer.mask
            rebuilt_layers[name].supports_masking = True
        _or_refusal(model, lambda: copy_weights(model, rebuilt), _rebuild_alone)
    return rebuilt
