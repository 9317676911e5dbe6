"""DimReduce's PCA matrix: components, snapshots, files and workers."""

import json
import os
import threading

import keras
import numpy as np
import pytest

from keras_thor.src.boost import pca_matrix as pca


def _flip(rows):
    largest = np.argmax(np.abs(rows), axis=1)
    return rows * np.sign(rows[np.arange(len(rows)), largest])[:, None]


def _model():
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(2),
        ]
    )


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(4, activation="relu")
        self.out = keras.layers.Dense(2)

    def call(self, x):
        return self.out(self.hidden(x))


def _save_snapshots(model, directory, count, seed=0, start=0):
    """Saves `count` perturbed snapshots; returns their flat weights."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(start, start + count):
        model.set_weights(
            [w + rng.normal(size=w.shape) for w in model.get_weights()]
        )
        model.save_weights(os.path.join(directory, f"snap_{i:03d}.weights.h5"))
        rows.append(pca.flat_weights(model.trainable_variables))
    return np.stack(rows)


def _assert_same_weights(model, weights):
    for actual, expected in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(actual, expected)


class TestComponents:
    def setup_method(self):
        rng = np.random.default_rng(1)
        self.snapshots = rng.normal(size=(12, 40)).astype("float32")

    def test_match_svd_with_sign_convention(self):
        matrix = pca.pca_components(self.snapshots, 5)
        centred = self.snapshots - self.snapshots.mean(axis=0)
        _, _, vt = np.linalg.svd(centred.astype("float64"))
        assert matrix.dtype == np.float32 and matrix.shape == (5, 40)
        # The same rows up to sign...
        np.testing.assert_allclose(
            np.abs(np.sum(matrix * vt[:5], axis=1)), 1.0, atol=1e-5
        )
        # ...and exactly the flip convention.
        np.testing.assert_allclose(matrix, _flip(vt[:5]), atol=1e-5)
        largest = np.argmax(np.abs(matrix), axis=1)
        assert np.all(matrix[np.arange(5), largest] > 0)
        np.testing.assert_allclose(matrix @ matrix.T, np.eye(5), atol=1e-5)

    def test_column_blocks_give_the_same_matrix(self, monkeypatch):
        whole = pca.pca_components(self.snapshots, 5)
        monkeypatch.setattr(pca, "BLOCK_COLUMNS", 7)
        np.testing.assert_array_equal(
            pca.pca_components(self.snapshots, 5), whole
        )

    def test_needs_more_snapshots_than_components(self):
        with pytest.raises(
            ValueError,
            match="more weight snapshots than `n_components`.*"
            "Received: 5 snapshots, n_components=5",
        ):
            pca.pca_components(self.snapshots[:5], 5)

    def test_duplicated_snapshots(self):
        snapshots = np.concatenate([self.snapshots[:3]] * 2)
        assert pca.pca_components(snapshots, 2).shape == (2, 40)
        with pytest.raises(ValueError, match="span fewer than n_components=3"):
            pca.pca_components(snapshots, 3)

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="Received: n_components=0"):
            pca.pca_components(self.snapshots, 0)
        with pytest.raises(TypeError, match="Received: n_components=True"):
            pca.pca_components(self.snapshots, True)
        with pytest.raises(ValueError, match=r"shape \(40,\)"):
            pca.pca_components(self.snapshots[0], 2)
        snapshots = self.snapshots.copy()
        snapshots[3, 4] = np.nan
        with pytest.raises(ValueError, match="NaN"):
            pca.pca_components(snapshots, 2)


def test_flat_weights_follow_trainable_variables_row_major():
    model = keras.Sequential(
        [
            keras.Input((4, 4, 1)),
            keras.layers.Conv2D(2, 3),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    offset = 0
    for v in model.trainable_variables:
        v.assign(np.arange(offset, offset + np.prod(v.shape)).reshape(v.shape))
        offset += int(np.prod(v.shape))
    flat = pca.flat_weights(model.trainable_variables)
    assert flat.dtype == np.float32
    np.testing.assert_array_equal(flat, np.arange(offset))
    kernel = model.trainable_variables[0].numpy()
    assert kernel.shape == (3, 3, 1, 2)
    np.testing.assert_array_equal(flat[:2], kernel[0, 0, 0, :])
    np.testing.assert_array_equal(flat[2:4], kernel[0, 1, 0, :])
    assert pca.flat_weights([]).shape == (0,)


def test_snapshot_files_sorted_and_errors(tmp_path):
    for name in ["b.weights.h5", "a.weights.h5", "c.h5", "notes.txt"]:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "d.weights.h5").mkdir()
    assert pca.snapshot_files(tmp_path) == [
        os.path.join(tmp_path, "a.weights.h5"),
        os.path.join(tmp_path, "b.weights.h5"),
    ]
    with pytest.raises(ValueError, match="Received: weight_load_dir=None$"):
        pca.snapshot_files(None)
    with pytest.raises(ValueError, match=r"\(no such directory\)"):
        pca.snapshot_files(str(tmp_path / "missing"))
    with pytest.raises(
        ValueError,
        match="must be an existing directory.*notes.txt'.*not a directory",
    ):
        pca.snapshot_files(str(tmp_path / "notes.txt"))


@pytest.mark.parametrize("subclassed", [False, True])
def test_load_snapshots_and_restore(tmp_path, subclassed):
    model = _Subclassed() if subclassed else _model()
    model(np.zeros((1, 3), "float32"))
    expected = _save_snapshots(model, tmp_path, 6)
    model.set_weights([w * 0.5 for w in model.get_weights()])
    weights = model.get_weights()
    snapshots = pca.load_snapshots(model, pca.snapshot_files(tmp_path))
    assert snapshots.dtype == np.float32
    np.testing.assert_array_equal(snapshots, expected)
    _assert_same_weights(model, weights)


def test_load_snapshots_restores_after_an_error(tmp_path):
    model = _model()
    _save_snapshots(model, tmp_path, 1)
    weights = model.get_weights()
    files = [*pca.snapshot_files(tmp_path), str(tmp_path / "no.weights.h5")]
    with pytest.raises((OSError, ValueError)):
        pca.load_snapshots(model, files)
    _assert_same_weights(model, weights)


def test_load_snapshots_warns_about_memory(tmp_path, monkeypatch):
    model = _model()
    _save_snapshots(model, tmp_path, 2)
    monkeypatch.setattr(pca, "SNAPSHOTS_WARNING_BYTES", 2 * 34 * 4 - 1)
    with pytest.warns(UserWarning, match="272 bytes: all snapshots are held"):
        pca.load_snapshots(model, pca.snapshot_files(tmp_path))


class TestLoadMatrix:
    def test_checks(self, tmp_path):
        path = str(tmp_path / "p.npy")
        np.save(path, np.ones((4, 120), "float64"))
        matrix = pca.load_pca_matrix(path, 4, 120)
        assert matrix.dtype == np.float32 and matrix.shape == (4, 120)
        np.save(path, np.ones((8, 100)))
        with pytest.raises(
            ValueError,
            match=r"p.npy' has shape \(8, 100\); DimReduce needs "
            r"\(n_components, trainable parameters\) = \(4, 120\)\.",
        ):
            pca.load_pca_matrix(path, 4, 120)
        np.save(path, np.array([{}], dtype=object), allow_pickle=True)
        with pytest.raises(ValueError, match="p.npy' cannot be read without"):
            pca.load_pca_matrix(path, 1, 1)
        np.save(path, np.array([["a"]]))
        with pytest.raises(ValueError, match="real numbers. Received: <U1"):
            pca.load_pca_matrix(path, 1, 1)
        nan = np.ones((4, 120))
        nan[1, 2] = np.nan
        np.save(path, nan)
        with pytest.raises(ValueError, match="NaN or infinite"):
            pca.load_pca_matrix(path, 4, 120)


class TestPcaMatrix:
    def setup_method(self):
        self.model = _model()
        self.dimension = 34

    def _snapshots(self, tmp_path, count=6):
        _save_snapshots(self.model, tmp_path, count)

    def test_computes_writes_and_reuses(self, tmp_path, monkeypatch):
        self._snapshots(tmp_path)
        weights = self.model.get_weights()
        matrix, path = pca.pca_matrix(self.model, 3, weight_load_dir=tmp_path)
        assert path == os.path.join(tmp_path, "pca_mat_temp.npy")
        expected = pca.pca_components(
            pca.load_snapshots(self.model, pca.snapshot_files(tmp_path)), 3
        )
        np.testing.assert_array_equal(matrix, expected)
        np.testing.assert_array_equal(np.load(path), expected)
        _assert_same_weights(self.model, weights)
        marker = json.loads((tmp_path / "pca_mat_temp.json").read_text())
        assert marker["n_components"] == 3
        assert marker["dimension"] == self.dimension
        names = [row[0] for row in marker["snapshots"]]
        assert names == [f"snap_{i:03d}.weights.h5" for i in range(6)]
        size = os.path.getsize(tmp_path / "snap_000.weights.h5")
        assert marker["snapshots"][0][1] == size
        assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]

        def fail(*args):
            raise AssertionError("recomputed")

        with monkeypatch.context() as patch:
            patch.setattr(pca, "pca_components", fail)
            again, _ = pca.pca_matrix(self.model, 3, weight_load_dir=tmp_path)
        np.testing.assert_array_equal(again, matrix)

    def test_recomputes_when_snapshots_or_k_change(self, tmp_path, monkeypatch):
        self._snapshots(tmp_path)
        calls = []
        compute = pca.pca_components

        def counted(snapshots, n_components):
            calls.append(len(snapshots))
            return compute(snapshots, n_components)

        monkeypatch.setattr(pca, "pca_components", counted)
        pca.pca_matrix(self.model, 3, weight_load_dir=tmp_path)
        _save_snapshots(self.model, tmp_path, 1, seed=1, start=6)
        pca.pca_matrix(self.model, 3, weight_load_dir=tmp_path)
        matrix, path = pca.pca_matrix(self.model, 2, weight_load_dir=tmp_path)
        assert calls == [6, 7, 7]
        assert matrix.shape == (2, self.dimension)
        assert np.load(path).shape == (2, self.dimension)

    def test_stale_marker_is_removed_before_computing(
        self, tmp_path, monkeypatch
    ):
        self._snapshots(tmp_path)
        pca.pca_matrix(self.model, 3, weight_load_dir=tmp_path)

        def fail(*args):
            raise RuntimeError("interrupted")

        monkeypatch.setattr(pca, "pca_components", fail)
        with pytest.raises(RuntimeError, match="interrupted"):
            pca.pca_matrix(self.model, 2, weight_load_dir=tmp_path)
        assert not (tmp_path / "pca_mat_temp.json").exists()

    def test_loads_an_existing_matrix_file(self, tmp_path):
        path = str(tmp_path / "given.npy")
        given = np.eye(3, self.dimension)
        np.save(path, given)
        matrix, used = pca.pca_matrix(self.model, 3, pca_mat_path=path)
        assert used == path
        np.testing.assert_array_equal(matrix, given)
        with pytest.raises(ValueError, match=r"= \(2, 34\)"):
            pca.pca_matrix(self.model, 2, pca_mat_path=path)

    def test_missing_matrix_file_falls_back_to_snapshots(self, tmp_path):
        self._snapshots(tmp_path)
        missing = str(tmp_path / "missing.npy")
        with pytest.warns(UserWarning, match="no existing `.npy` file"):
            _, path = pca.pca_matrix(
                self.model, 3, pca_mat_path=missing, weight_load_dir=tmp_path
            )
        assert path == os.path.join(tmp_path, "pca_mat_temp.npy")

    def test_errors(self, tmp_path):
        missing = str(tmp_path / "missing")
        with pytest.raises(
            ValueError,
            match=r"must be an existing directory. Received: "
            r"weight_load_dir='.*missing' \(no such directory\)",
        ):
            pca.pca_matrix(self.model, 3, weight_load_dir=missing)
        with pytest.raises(
            ValueError,
            match="`pca_mat_path` must name an existing `.npy` file, or "
            "argument `weight_load_dir`.*Received: pca_mat_path='.*p.npy' "
            r"\(no such .npy file\), weight_load_dir=None",
        ):
            pca.pca_matrix(self.model, 3, pca_mat_path=str(tmp_path / "p.npy"))
        self._snapshots(tmp_path, count=3)
        with pytest.raises(
            ValueError, match="Received: 3 snapshots in weight_load_dir="
        ):
            pca.pca_matrix(self.model, 3, weight_load_dir=tmp_path)
        with pytest.raises(ValueError, match="Received: timeout=0.0"):
            pca.pca_matrix(self.model, 2, weight_load_dir=tmp_path, timeout=0)
        with pytest.raises(TypeError, match="Received: n_components=2.0"):
            pca.pca_matrix(self.model, 2.0, weight_load_dir=tmp_path)
        with pytest.raises(ValueError, match="built model with trainable"):
            pca.pca_matrix(keras.Sequential(), 2, weight_load_dir=tmp_path)

    def test_warns_about_matrix_size(self, tmp_path, monkeypatch):
        self._snapshots(tmp_path)
        monkeypatch.setattr(pca, "MATRIX_WARNING_BYTES", 0)
        with pytest.warns(UserWarning, match="P takes 408 bytes per replica"):
            pca.pca_matrix(self.model, 3, weight_load_dir=tmp_path)

    def test_non_chief_waits_for_the_chief(self, tmp_path):
        self._snapshots(tmp_path)
        chief_model = _model()
        result = {}

        def chief():
            result["chief"] = pca.pca_matrix(
                chief_model, 3, weight_load_dir=tmp_path
            )

        timer = threading.Timer(0.3, chief)
        timer.start()
        try:
            matrix, path = pca.pca_matrix(
                self.model,
                3,
                weight_load_dir=tmp_path,
                timeout=5,
                is_chief=False,
                poll_interval=0.05,
            )
        finally:
            timer.join()
        chief_matrix, chief_path = result["chief"]
        assert path == chief_path
        np.testing.assert_array_equal(matrix, chief_matrix)

    def test_non_chief_times_out(self, tmp_path):
        self._snapshots(tmp_path)
        with pytest.raises(
            RuntimeError,
            match=r"Waited 0.3 s for the chief worker to write the PCA "
            r"matrix '.*pca_mat_temp.npy' \(marker '.*pca_mat_temp.json'\); "
            "the marker is missing",
        ):
            pca.pca_matrix(
                self.model,
                3,
                weight_load_dir=tmp_path,
                timeout=0.3,
                is_chief=False,
                poll_interval=0.05,
            )
