"""Assets shipped inside the package: the embedded tiny model and its tokenizer."""

from pathlib import Path

ASSETS_DIR = Path(__file__).parent
DEFAULT_MODEL_DIR = ASSETS_DIR / "tiny-qwen2"
"""The embedded default model (Hugging Face folder, warm-started on the arithmetic task)."""
