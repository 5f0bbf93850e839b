"""Image prompts from data files: the embedded visual task's files, JSONL and Parquet rows with
an image column read through ``datasets``' Image feature, and the error that names the file
and the row of an image that is missing or unreadable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.assets import VISUAL_MODEL_DIR
from tandem.cli import main
from tandem.cluster import ray_cluster
from tandem.config.models import DataConfig
from tandem.data.images import RowImages, png_bytes
from tandem.data.prompts import PromptSource, load_prompt_file, load_prompt_items, load_tokenizer
from tandem.data.visual import COLOURS, QUESTION, Scene, scenes, write_visual_task


def _task(tmp_path: Path, num_train: int = 40, num_eval: int = 12) -> Path:
    return write_visual_task(tmp_path / "task", num_train, num_eval, seed=3)


def test_the_task_files_answer_from_the_image_alone(tmp_path: Path) -> None:
    folder = _task(tmp_path)
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 40 and {r["question"] for r in rows} == {QUESTION}  # one text for all
    assert {r["answer"] for r in rows} <= {"1", "2", "3", "4"}
    assert len({r["answer"] for r in rows}) > 1
    train_keys = {s.key() for s in scenes(2000, 3, held_out=False)}
    eval_keys = {s.key() for s in scenes(200, 0, held_out=True)}
    assert not train_keys & eval_keys  # no held-out image is trained on


def test_a_scene_draws_its_shapes_in_its_colour() -> None:
    import numpy as np

    scene = Scene(((0, "circle"), (5, "square"), (7, "triangle")), "blue")
    pixels = np.asarray(scene.draw())
    coloured = (pixels != 255).any(-1)
    cells = {(y // 16) * 3 + x // 16 for y, x in zip(*coloured.nonzero(), strict=True)}
    assert cells == {0, 5, 7} and scene.answer == "3"  # blue is the question's 3
    assert {tuple(p) for p in pixels[coloured]} == {COLOURS["blue"]}
    assert "3=blue" in QUESTION


def test_jsonl_rows_load_with_their_images_and_encode_to_image_prompts(tmp_path: Path) -> None:
    folder = _task(tmp_path)
    config = DataConfig(task="jsonl", train_path=folder / "train.jsonl", image_key="image")
    items = load_prompt_file(folder / "train.jsonl", config)
    assert len(items) == 40 and items[0]["image"].size == (48, 48)
    source = PromptSource(
        items, items, load_tokenizer(VISUAL_MODEL_DIR), _zero, 0, VISUAL_MODEL_DIR
    )
    prompts = [source.encode_prompt(item) for item in items[:3]]
    assert all(p.images.image_grid_thw.tolist() == [[1, 6, 6]] for p in prompts)
    rows = RowImages.of(prompts)
    assert rows is not None and rows.select(slice(1, 3)).rows == rows.rows[1:3]
    merged = rows.select([2, 0]).merged()
    assert merged is not None and merged.pixel_values.shape[0] == 2 * 36


def _zero(prompt: str, response: str, answer: str) -> float:
    return 0.0


def test_parquet_rows_hold_image_bytes(tmp_path: Path) -> None:
    import datasets

    images = [png_bytes(s.draw()) for s in scenes(3, 0, held_out=False)]
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_dict(
        {"question": ["q"] * 3, "answer": ["1", "2", "3"], "picture": images}
    ).to_parquet(str(path))
    config = DataConfig(task="jsonl", train_path=path, image_key="picture")
    items = load_prompt_file(path, config)
    assert [i["image"].size for i in items] == [(48, 48)] * 3


def test_the_visual_task_loads_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    monkeypatch.setattr("tandem.data.visual.NUM_TRAIN", 30)
    train, eval_items = load_prompt_items(DataConfig(task="visual", num_eval_prompts=8), 0)
    assert len(train) == 30 and len(eval_items) == 8 and "image" in eval_items[0]


def _bad_row(tmp_path: Path, image: str) -> Path:
    folder = _task(tmp_path, num_train=3)
    path = folder / "train.jsonl"
    rows = path.read_text().splitlines()
    rows[1] = json.dumps({"question": "q", "answer": "2", "image": image})
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("images/nope.png", "train.jsonl row 2: image file not found: "),
        ("garbage.png", "train.jsonl row 2: cannot read image "),
    ],
)
def test_a_bad_image_exits_2_naming_file_and_row(
    image: str,
    expected: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _bad_row(tmp_path, image)
    (path.parent / "garbage.png").write_bytes(b"not a png at all")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ray_cluster, "init_ray", _no_ray)
    args = [
        "grpo",
        "policy.model_path=embedded:tiny-qwen2.5-vl",
        "data.task=jsonl",
        f"data.train_path={path}",
        "data.image_key=image",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count(": error: ") == 1, err
    assert expected in err and image.split("/")[-1] in err, err


def _no_ray(*_: object) -> None:
    raise AssertionError("Ray started for a bad input")


def test_image_prompts_need_a_vision_language_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ray_cluster, "init_ray", _no_ray)
    assert main(["grpo", "data.task=visual"]) == 2
    assert "need a vision-language policy" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_image_prompts_refuse_the_vllm_generator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where torchvision does not import (vLLM cannot load a Qwen2-VL model without it)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ray_cluster, "init_ray", _no_ray)
    monkeypatch.setattr("tandem.imports.import_error", _no_torchvision)
    assert main(["grpo", "--config", "grpo_visual", "generation.backend=vllm"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count(": error: ") == 1, err
    assert "generation.backend=vllm: image prompts with the vLLM generator need torch" in err
    assert "No module named 'torchvision'" in err, err
    assert "torchvision build matching torch" in err and "generation.backend=hf" in err, err
    assert not (tmp_path / "runs").exists()


def _no_torchvision(name: str) -> str | None:
    return "ModuleNotFoundError: No module named 'torchvision'" if name == "torchvision" else None


def test_image_prompts_go_to_the_vllm_generator_where_torchvision_imports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tandem.config.models import GenerationConfig
    from tandem.preflight import check_image_generator

    monkeypatch.setattr("tandem.imports.import_error", lambda name: None)
    check_image_generator(GenerationConfig(backend="vllm"))  # no error
    monkeypatch.setattr("tandem.imports.import_error", _no_torchvision)
    with pytest.raises(ValueError, match="need torchvision"):
        check_image_generator(GenerationConfig(backend="vllm"))
    check_image_generator(GenerationConfig(backend="hf"))  # transformers: no torchvision needed
