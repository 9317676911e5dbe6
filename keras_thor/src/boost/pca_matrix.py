"""The PCA matrix `P` (k × D, orthonormal rows) of DimReduce.

Transcribed from MindSpore's `boost/base.py` (`_get_local_pca_mat_path`,
`_load_weights`, `_compute_pca_mat`). Column `j` of `P` is parameter `j`
of `model.trainable_variables`, taken in order, each variable flattened
row-major (`reshape(-1)`) in Keras's layout. The rows of `P` are the top-k
principal directions of weight snapshots saved during earlier training.
"""

import json
import os
import time
import warnings

import numpy as np

from keras_thor.src.backend.values import numpy_value
from keras_thor.src.utils.validation import check_bool
from keras_thor.src.utils.validation import check_float
from keras_thor.src.utils.validation import check_int

SNAPSHOT_SUFFIX = ".weights.h5"
MATRIX_NAME = "pca_mat_temp.npy"
MARKER_NAME = "pca_mat_temp.json"

# Warn above these sizes (bytes of float32).
SNAPSHOTS_WARNING_BYTES = 2 << 30
MATRIX_WARNING_BYTES = 1 << 30

# An eigenvalue of the Gram matrix `C Cᵀ` at or below this fraction of the
# largest is zero: Gram eigenvalues are accurate to about 1e-16 of the
# largest, so `σ_k ≤ 1e-6 σ_1`.
RANK_TOLERANCE = 1e-12

# Columns of the centred snapshots held in float64 at once.
BLOCK_COLUMNS = 1 << 18


def flat_weights(variables):
    """Concatenation of the variables flattened row-major, float32 (D,).

    Values are read with `numpy_value`, which is `keras.ops.convert_to_numpy`
    without NumPy 2's `__array__` deprecation warning.
    """
    return np.concatenate(
        [np.zeros(0, np.float32)]
        + [np.asarray(numpy_value(v), np.float32).ravel() for v in variables]
    )


def _dimension(variables):
    """D = the total number of entries of `variables`."""
    return sum(int(np.prod(v.shape)) for v in variables)


def _check_snapshot_count(count, n_components, where=""):
    """Centred snapshots span at most `n − 1` directions: needs n > k."""
    if count <= n_components:
        raise ValueError(
            "DimReduce needs more weight snapshots than `n_components` "
            "(n centred snapshots span at most n - 1 directions). "
            f"Received: {count} snapshots{where}, n_components={n_components}"
        )


def _centred_blocks(snapshots, mean):
    """Yields `(columns, C[:, columns])` in float64, `C = W − mean`."""
    for start in range(0, snapshots.shape[1], BLOCK_COLUMNS):
        columns = slice(start, start + BLOCK_COLUMNS)
        yield columns, snapshots[:, columns].astype(np.float64) - mean[columns]


def _flip_signs(components):
    """Multiplies each row by the sign of its largest-magnitude entry."""
    largest = np.argmax(np.abs(components), axis=1)
    signs = np.sign(components[np.arange(len(components)), largest])
    return components * signs[:, None]


def pca_components(snapshots, n_components):
    """Top-k right singular vectors of the centred snapshots, float32 (k, D).

    `C = W − mean(W, axis=0)`; `C Cᵀ = U Λ Uᵀ` (float64, eigenvalues
    descending); `V_k = U_kᵀ C / σ_k` with `σ = sqrt(λ)`. Each row's sign
    makes its largest-magnitude entry positive.

    Args:
        snapshots: `(n, D)` array, one flattened weight snapshot per row.
        n_components: k, the number of rows of `P`; needs `n > k`.
    """
    n_components = check_int("n_components", n_components, minimum=1)
    snapshots = np.asarray(snapshots)
    if snapshots.ndim != 2:
        raise ValueError(
            "Argument `snapshots` must be a 2-D array (snapshots, "
            f"parameters). Received: snapshots with shape {snapshots.shape}"
        )
    _check_snapshot_count(len(snapshots), n_components)
    mean = snapshots.mean(axis=0, dtype=np.float64)
    gram = np.zeros((len(snapshots), len(snapshots)))
    for _, block in _centred_blocks(snapshots, mean):
        gram += block @ block.T
    if not np.isfinite(gram).all():
        raise ValueError("The weight snapshots hold NaN or infinite values.")
    eigenvalues, eigenvectors = np.linalg.eigh(gram)
    eigenvalues = eigenvalues[::-1][:n_components]
    eigenvectors = eigenvectors[:, ::-1][:, :n_components]
    if not eigenvalues[-1] > RANK_TOLERANCE * eigenvalues[0]:
        raise ValueError(
            f"The {len(snapshots)} weight snapshots span fewer than "
            f"n_components={n_components} directions (are some snapshots "
            "duplicated?). Use more distinct snapshots or a smaller "
            f"`n_components`. Singular values: {np.sqrt(np.abs(eigenvalues))}"
        )
    sigma = np.sqrt(eigenvalues)
    components = np.empty((n_components, snapshots.shape[1]), np.float32)
    for columns, block in _centred_blocks(snapshots, mean):
        components[:, columns] = (eigenvectors.T @ block) / sigma[:, None]
    return _flip_signs(components)


def _check_directory(weight_load_dir):
    """Raises unless `weight_load_dir` is an existing directory."""
    if isinstance(weight_load_dir, (str, os.PathLike)):
        if os.path.isdir(weight_load_dir):
            return
        why = (
            " (not a directory)"
            if os.path.exists(weight_load_dir)
            else " (no such directory)"
        )
    else:
        why = ""
    raise ValueError(
        "Argument `weight_load_dir` must be an existing directory. "
        f"Received: weight_load_dir={weight_load_dir!r}{why}"
    )


def snapshot_files(weight_load_dir):
    """Paths of every `*.weights.h5` in `weight_load_dir`, sorted by name.

    MindSpore takes `os.listdir` order; sorting makes every worker and
    every run agree on the snapshot order.
    """
    _check_directory(weight_load_dir)
    return [
        os.path.join(weight_load_dir, name)
        for name in sorted(os.listdir(weight_load_dir))
        if name.endswith(SNAPSHOT_SUFFIX)
        and os.path.isfile(os.path.join(weight_load_dir, name))
    ]


def load_snapshots(model, files):
    """Flat trainable weights of each snapshot file, float32 (n, D).

    Row `i` is `flat_weights(model.trainable_variables)` after
    `model.load_weights(files[i])`. The model's own weights are restored
    afterwards, and its optimizer's state is not touched.
    """
    dimension = _dimension(model.trainable_variables)
    size = len(files) * dimension * 4
    if size > SNAPSHOTS_WARNING_BYTES:
        warnings.warn(
            f"Loading {len(files)} weight snapshots of {dimension} "
            f"parameters takes {size} bytes: all snapshots are held in "
            "memory while P is computed.",
            stacklevel=2,
        )
    snapshots = np.empty((len(files), dimension), np.float32)
    weights = model.get_weights()
    # The optimizer is set aside: a snapshot's optimizer state (saved by
    # `ModelCheckpoint`) must not reach the optimizer training now.
    optimizer = getattr(model, "optimizer", None)
    model.optimizer = None
    try:
        for row, file in enumerate(files):
            model.load_weights(file)
            snapshots[row] = flat_weights(model.trainable_variables)
    finally:
        model.optimizer = optimizer
        model.set_weights(weights)
    return snapshots


def load_pca_matrix(path, n_components, dimension):
    """`P` from the `.npy` file `path`, checked: float32 (k, D), finite."""
    try:
        matrix = np.load(path, allow_pickle=False)
    except ValueError as error:
        raise ValueError(
            f"The PCA matrix file {os.fspath(path)!r} cannot be read "
            "without pickling (it holds Python objects or is no `.npy` "
            "file). Save a numeric array with `np.save`."
        ) from error
    if not isinstance(matrix, np.ndarray) or matrix.dtype.kind not in "fiu":
        kind = matrix.dtype if isinstance(matrix, np.ndarray) else "an archive"
        raise ValueError(
            f"The PCA matrix in {os.fspath(path)!r} must be an array of "
            f"real numbers. Received: {kind}"
        )
    expected = (n_components, dimension)
    if matrix.shape != expected:
        raise ValueError(
            f"The PCA matrix in {os.fspath(path)!r} has shape "
            f"{matrix.shape}; DimReduce needs (n_components, trainable "
            f"parameters) = {expected}."
        )
    matrix = matrix.astype(np.float32)
    if not np.isfinite(matrix).all():
        raise ValueError(
            f"The PCA matrix in {os.fspath(path)!r} holds NaN or infinite "
            "values (in float32)."
        )
    return matrix


def _marker(files, n_components, dimension):
    """What the marker file records: k, D and each snapshot's
    `[file name, size in bytes, mtime_ns]`."""
    snapshots = []
    for file in files:
        status = os.stat(file)
        snapshots.append(
            [os.path.basename(file), status.st_size, status.st_mtime_ns]
        )
    return {
        "n_components": n_components,
        "dimension": dimension,
        "snapshots": snapshots,
    }


def _read_marker(path):
    """The marker's content, or None when it is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, ValueError):
        return None


def _write_atomically(path, write):
    """Calls `write(file)` on a temporary file, then renames it to `path`."""
    temporary = f"{path}.{os.getpid()}-{time.time_ns()}.tmp"
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _check_positive(name, value):
    """Returns `value` as a float if it is a finite number > 0."""
    value = check_float(name, value)
    if value <= 0:
        raise ValueError(
            f"Argument `{name}` must be > 0. Received: {name}={value!r}"
        )
    return value


def _is_matrix_file(pca_mat_path):
    """Whether `pca_mat_path` names an existing `.npy` file."""
    if pca_mat_path is None:
        return False
    if not isinstance(pca_mat_path, (str, os.PathLike)):
        raise TypeError(
            "Argument `pca_mat_path` must be a path or None. "
            f"Received: pca_mat_path={pca_mat_path!r} "
            f"(of type {type(pca_mat_path).__name__})"
        )
    return os.path.isfile(pca_mat_path) and os.fspath(pca_mat_path).endswith(
        ".npy"
    )


def _compute(model, files, marker, matrix_path, marker_path):
    """Chief: computes `P`, writes the `.npy`, then the marker, each
    atomically; a stale marker is removed first."""
    if os.path.exists(marker_path):
        os.remove(marker_path)
    matrix = pca_components(
        load_snapshots(model, files), marker["n_components"]
    )
    _write_atomically(matrix_path, lambda file: np.save(file, matrix))
    _write_atomically(
        marker_path, lambda file: file.write(json.dumps(marker).encode())
    )
    return matrix


def _wait(weight_load_dir, n_components, dimension, timeout, poll_interval):
    """Non-chief: polls for a matching marker, then loads `P`."""
    matrix_path = os.path.join(weight_load_dir, MATRIX_NAME)
    marker_path = os.path.join(weight_load_dir, MARKER_NAME)
    deadline = time.monotonic() + timeout
    while True:
        marker = _marker(
            snapshot_files(weight_load_dir), n_components, dimension
        )
        found = _read_marker(marker_path)
        if found == marker and os.path.isfile(matrix_path):
            return load_pca_matrix(matrix_path, n_components, dimension)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            why = (
                "the marker is missing"
                if found is None
                else "the marker describes other snapshots or arguments"
            )
            raise RuntimeError(
                f"Waited {timeout:g} s for the chief worker to write the "
                f"PCA matrix {matrix_path!r} (marker {marker_path!r}); "
                f"{why}. The chief (is_chief=True) must run with the same "
                "`weight_load_dir`, snapshots and `n_components`; or raise "
                "`timeout`."
            )
        time.sleep(min(poll_interval, remaining))


def pca_matrix(
    model,
    n_components,
    pca_mat_path=None,
    weight_load_dir=None,
    timeout=1800,
    is_chief=True,
    poll_interval=0.5,
):
    """DimReduce's `P` (float32, k × D) and the `.npy` path it came from.

    MindSpore's rule: an existing `.npy` file `pca_mat_path` is loaded.
    Otherwise `P` comes from the `*.weights.h5` snapshots in
    `weight_load_dir` (see `pca_components`) and is kept in
    `<weight_load_dir>/pca_mat_temp.npy`, next to the marker
    `pca_mat_temp.json` that records k, D and the snapshots it was
    computed from. The chief reuses a matching pair or computes and writes
    it; other workers poll every `poll_interval` s until the matching
    marker appears, for at most `timeout` s.

    Args:
        model: a built model; D is the size of `model.trainable_variables`.
        n_components: k, the dimension of the subspace.
        pca_mat_path: optional path of a precomputed `.npy` matrix.
        weight_load_dir: directory of the snapshots written by
            `model.save_weights` from the same architecture.
        timeout: seconds a non-chief worker waits for the chief.
        is_chief: whether this worker computes `P`.
        poll_interval: seconds between a non-chief worker's checks.
    """
    n_components = check_int("n_components", n_components, minimum=1)
    timeout = _check_positive("timeout", timeout)
    poll_interval = _check_positive("poll_interval", poll_interval)
    is_chief = check_bool("is_chief", is_chief)
    dimension = _dimension(model.trainable_variables)
    if dimension == 0:
        raise ValueError(
            "DimReduce needs a built model with trainable variables. "
            f"Received: model {model.name!r} with none"
        )
    if n_components * dimension * 4 > MATRIX_WARNING_BYTES:
        warnings.warn(
            f"P takes {n_components * dimension * 4} bytes per replica "
            f"(n_components={n_components} × {dimension} parameters, "
            "float32).",
            stacklevel=2,
        )
    if _is_matrix_file(pca_mat_path):
        return (
            load_pca_matrix(pca_mat_path, n_components, dimension),
            os.fspath(pca_mat_path),
        )
    if pca_mat_path is not None:
        try:
            _check_directory(weight_load_dir)
        except ValueError as error:
            raise ValueError(
                "Argument `pca_mat_path` must name an existing `.npy` file, "
                "or argument `weight_load_dir` an existing directory of "
                "weight snapshots to compute it from. Received: "
                f"pca_mat_path={pca_mat_path!r} (no such .npy file), "
                f"weight_load_dir={weight_load_dir!r}"
            ) from error
        warnings.warn(
            f"pca_mat_path={pca_mat_path!r} is no existing `.npy` file; "
            "computing P from the snapshots in "
            f"weight_load_dir={weight_load_dir!r}.",
            stacklevel=2,
        )
    files = snapshot_files(weight_load_dir)
    _check_snapshot_count(
        len(files), n_components, f" in weight_load_dir={weight_load_dir!r}"
    )
    matrix_path = os.path.join(weight_load_dir, MATRIX_NAME)
    if not is_chief:
        matrix = _wait(
            weight_load_dir, n_components, dimension, timeout, poll_interval
        )
        return matrix, matrix_path
    marker_path = os.path.join(weight_load_dir, MARKER_NAME)
    marker = _marker(files, n_components, dimension)
    if _read_marker(marker_path) == marker and os.path.isfile(matrix_path):
        matrix = load_pca_matrix(matrix_path, n_components, dimension)
    else:
        matrix = _compute(model, files, marker, matrix_path, marker_path)
    return matrix, matrix_path
