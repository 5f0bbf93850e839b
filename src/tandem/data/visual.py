"""The embedded visual task: name the colour of the shapes drawn in a small image.

Each 48x48 image is a 3x3 grid of 16-pixel cells (one cell per merged patch of the embedded
model's vision tower) with 1 to ``MAX_SHAPES`` shapes (circle, square or triangle) in distinct
cells on white, all of one colour. The prompt is the same text for every image (it lists the
colours' numbers), so the answer depends on the image alone: a policy that does not look at it
scores at chance (1 in 4). The answer is the colour's number (the ``exact_match`` reward).

(Counting the shapes instead, an answer spread over several image tokens, stayed at chance
for 300 supervised steps from the random initialisation of the tiny model; the colour is in
every shape's token.)

The task is written as files a user could have made: ``train.jsonl`` and ``eval.jsonl`` with
``question``, ``answer`` and ``image`` (a PNG path relative to the file) columns, read like any
data file with an image column (``data.image_key``). The held-out split is a fixed hash of an
image's layout (its cells, shapes and colour), independent of the seed, so no held-out image
is trained on.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE_SIZE = 48
CELL = 16
MAX_SHAPES = 4
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (40, 60, 220),
    "yellow": (230, 200, 20),
}
QUESTION = "Colour of the shapes? " + " ".join(f"{n}={c}" for n, c in enumerate(COLOURS, 1))
SHAPES = ("circle", "square", "triangle")
_SPLIT_SALT = b"tandem-visual-v2"
EVAL_FRACTION = 0.1


@dataclass(frozen=True)
class Scene:
    """One image: ``(cell, shape)`` per shape (cells 0..8 row-major), all of ``colour``."""

    items: tuple[tuple[int, str], ...]
    colour: str

    @property
    def answer(self) -> str:
        """The colour's number (1-4, as the question lists them)."""
        return str(list(COLOURS).index(self.colour) + 1)

    def key(self) -> bytes:
        return json.dumps([sorted(self.items), self.colour]).encode()

    def held_out(self) -> bool:
        digest = hashlib.blake2b(self.key(), key=_SPLIT_SALT, digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < EVAL_FRACTION

    def draw(self) -> Any:
        """The scene as an RGB PIL image (white background)."""
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
        pen = ImageDraw.Draw(image)
        fill = COLOURS[self.colour]
        for cell, shape in self.items:
            x, y = (cell % 3) * CELL + 1, (cell // 3) * CELL + 1
            box = (x, y, x + CELL - 3, y + CELL - 3)
            if shape == "circle":
                pen.ellipse(box, fill=fill)
            elif shape == "square":
                pen.rectangle(box, fill=fill)
            else:
                pen.polygon([(x, box[3]), (box[2], box[3]), ((x + box[2]) // 2, y)], fill=fill)
        return image


def random_scene(rng: random.Random) -> Scene:
    """1..MAX_SHAPES shapes (the count uniform) in distinct cells, of a uniform colour."""
    cells = sorted(rng.sample(range(9), rng.randint(1, MAX_SHAPES)))
    return Scene(tuple((c, rng.choice(SHAPES)) for c in cells), rng.choice(list(COLOURS)))


def scenes(num: int, seed: int, held_out: bool) -> list[Scene]:
    """``num`` scenes of one split drawn from a seeded stream (repeats possible in training)."""
    rng = random.Random(f"{seed}-{'eval' if held_out else 'train'}")
    out: list[Scene] = []
    while len(out) < num:
        scene = random_scene(rng)
        if scene.held_out() == held_out:
            out.append(scene)
    return out


def write_split(folder: Path, name: str, items: list[Scene]) -> Path:
    """``folder/name.jsonl`` and its PNGs under ``folder/images/``."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for index, scene in enumerate(items):
        relative = f"images/{name}_{index:05d}.png"
        scene.draw().save(folder / relative)
        row = {"question": QUESTION, "answer": scene.answer, "image": relative}
        lines.append(json.dumps(row))
    path = folder / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_visual_task(folder: Path, num_train: int, num_eval: int, seed: int = 0) -> Path:
    """The task's files in ``folder`` (kept when complete): ``train.jsonl``, ``eval.jsonl``
    (the first ``num_eval`` held-out scenes, the same for every seed) and their images."""
    if (folder / "eval.jsonl").is_file():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    write_split(partial, "train", scenes(num_train, seed, held_out=False))
    write_split(partial, "eval", scenes(num_eval, 0, held_out=True))
    try:
        partial.rename(folder)  # a folder that exists is complete
    except OSError:  # another process finished first
        if not (folder / "eval.jsonl").is_file():
            raise
        shutil.rmtree(partial, ignore_errors=True)
    return folder


NUM_TRAIN = 4000
"""Training images of ``data.task: visual`` (drawn with repeats; about 15 epochs of the
recipe's steps)."""


def cached_visual_task(num_eval: int, seed: int, num_train: int | None = None) -> Path:
    """``write_visual_task`` into the cache (``$TANDEM_CACHE``, else ``~/.cache/tandem``)."""
    import os

    num_train = NUM_TRAIN if num_train is None else num_train
    base = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
    folder = base / "data" / f"visual-colour-v2-{num_train}-{num_eval}-{seed}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    return write_visual_task(folder, num_train, num_eval, seed)
