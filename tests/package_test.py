"""The package's public surface and its import rules."""

import ast
import pathlib

import pytest

import keras_thor

PACKAGE = pathlib.Path(keras_thor.__file__).parent
# The only modules that may import tensorflow (inside functions, lazily).
TENSORFLOW_MODULES = {
    "src/boost/training.py",
    "src/backend/dense.py",
    "src/backend/fusion.py",
    "src/backend/linalg.py",
    "src/backend/memory_update.py",
    "src/backend/patches.py",
    "src/backend/single_device.py",
    "src/backend/stateless_random.py",
    "src/distribute/replicas.py",
    "src/distribute/strategies.py",
    "src/distribute/train_step.py",
    "src/distribute/variant_train_function.py",
    "src/thor/tape_gradients.py",
}
JAX_MODULES = {
    "src/backend/linalg.py",
    "src/backend/stateless_random.py",
    "src/distribute/jax_variant_train_function.py",
    "src/thor/probe_gradients.py",
}
BACKEND_MODULES = {"tensorflow": TENSORFLOW_MODULES, "jax": JAX_MODULES}


def _imports_of(node):
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield node, alias.name
    elif isinstance(node, ast.ImportFrom) and node.module:
        yield node, node.module


def _imports(path):
    for node in ast.walk(ast.parse(path.read_text())):
        yield from _imports_of(node)


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_public_modules_export_the_optimizers_and_callbacks():
    assert keras_thor.optimizers.__all__ == ["ASGD", "SAG", "THOR"]
    assert keras_thor.thor is keras_thor.optimizers.THOR
    assert keras_thor.layers.__all__ == [
        "FullNorm",
        "LossScaleGroup",
        "ThorConv2D",
        "ThorDense",
        "ThorEmbedding",
        "ThorLayerNormalization",
    ]
    assert "convert_to_thor_model" in keras_thor.models.__all__
    assert keras_thor.convert_to_thor_model is (
        keras_thor.models.convert_to_thor_model
    )
    assert keras_thor.to_keras_model is keras_thor.models.to_keras_model
    assert keras_thor.load_model is keras_thor.models.load_model
    assert keras_thor.curvature_coverage.__doc__
    assert keras_thor.callbacks.__all__ == [
        "DimReduce",
        "GradientFreeze",
        "GroupLossScale",
        "SwapAveragedWeights",
    ]
    # One name, one thing: the boost callbacks are the boost classes.
    assert keras_thor.callbacks.DimReduce is keras_thor.boost.DimReduce
    assert (
        keras_thor.callbacks.GradientFreeze is keras_thor.boost.GradientFreeze
    )
    assert keras_thor.boost.__all__ == [
        "AdaSum",
        "AutoBoost",
        "BoostOptimizer",
        "DimReduce",
        "GradientAccumulation",
        "GradientFreeze",
        "GroupLossScaleManager",
        "LessBN",
        "OptimizerProcess",
        "to_boost_model",
    ]
    for name in keras_thor.boost.__all__:
        assert getattr(keras_thor.boost, name).__doc__
    assert "BoostFunctional" in keras_thor.models.__all__
    assert "ThorResNetLearningRate" in keras_thor.schedules.__all__
    for name in keras_thor.optimizers.__all__:
        assert getattr(keras_thor.optimizers, name).__doc__
    assert keras_thor.__version__.count(".") == 2


def test_no_private_keras_imports():
    for path in _modules():
        for _, module in _imports(path):
            assert not module.startswith("keras.src"), path


@pytest.mark.parametrize("backend", sorted(BACKEND_MODULES))
def test_backends_are_imported_lazily_and_only_in_backend_modules(backend):
    for path in _modules():
        relative = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text())
        top_level = [
            module.split(".")[0]
            for node in tree.body
            for imported, module in _imports_of(node)
        ]
        assert backend not in top_level, relative
        uses = [m for _, m in _imports(path) if m.split(".")[0] == backend]
        if uses:
            assert relative in BACKEND_MODULES[backend], relative


def test_docstring_templates_are_filled():
    for name in keras_thor.optimizers.__all__:
        doc = getattr(keras_thor.optimizers, name).__doc__
        assert "{{" not in doc
        assert "gradient_accumulation_steps" in doc


# Folders of keras_thor/src from low to high: a module imports only from its
# own folder and lower ones.
LAYERS = [
    {"version", "api_export", "keras_internals", "utils"},
    {"backend"},
    {"distribute"},
    {"schedules"},
    {"optimizers", "layers"},
    {"callbacks"},
    {"thor"},
    {"boost"},
    {"loading"},
]


def _folder(module):
    return module.removeprefix("keras_thor.src.").split(".")[0]


def _rank(folder):
    return next(i for i, layer in enumerate(LAYERS) if folder in layer)


def _internal_imports():
    """`{module: {imported keras_thor.src modules}}`, lazy imports too."""
    graph = {}
    for path in (PACKAGE / "src").rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(p for p in parts if p != "__init__")
        graph[module] = set()
        for node, imported in _imports(path):
            if not imported.startswith("keras_thor.src"):
                continue
            if isinstance(node, ast.ImportFrom) and imported in (
                "keras_thor.src",
            ):
                graph[module] |= {f"{imported}.{a.name}" for a in node.names}
            else:
                graph[module].add(imported)
    return graph


def test_imports_run_one_way():
    for module, imported in _internal_imports().items():
        if module == "keras_thor.src":
            continue
        for target in imported:
            assert _rank(_folder(target)) <= _rank(_folder(module)), (
                f"{module} imports {target}"
            )


def test_no_import_cycles():
    graph = _internal_imports()

    def resolve(target):
        # `from keras_thor.src.thor import capture` names a module.
        return target if target in graph else target.rsplit(".", 1)[0]

    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            target = resolve(target)
            if target == module or target not in graph:
                continue
            assert state.get(target) != "open", " -> ".join(path + [target])
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
