"""Data files as users save them: JSONL, JSON, CSV or Parquet, read with ``datasets``. Text files
are UTF-8 with or without a byte-order mark (spreadsheets and Windows tools write one) and with
either line ending; another encoding, another format, or a file its reader cannot parse is a
``ValueError`` naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

READERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
"""The ``datasets`` builder of each file suffix."""


def text_lines(path: Path) -> list[str]:
    """The lines of a text data file, checked to be UTF-8 (a byte-order mark dropped)."""
    from tandem.config.load import read_text

    return read_text(path, "data file").splitlines()


def read_rows(path: Path) -> Any:
    """The rows of ``path`` (a ``datasets.Dataset``)."""
    builder = READERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(
            f"{path}: data files are .jsonl, .json, .csv or .parquet (this one is "
            f"{path.suffix or 'without a suffix'})"
        )
    options: dict[str, Any] = {}
    if builder != "parquet":
        text_lines(path)  # an encoding other than UTF-8 is named here, not as a parser error
        options["encoding"] = "utf-8-sig"
    import datasets

    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", **options)
    except Exception as err:  # the reader's own error (pyarrow, pandas) names what it met
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        cause = err.__cause__ or err.__context__
        if cause is not None and str(cause).strip():
            reason = str(cause).strip().splitlines()[0]
        raise ValueError(f"{path}: cannot be read as {path.suffix[1:]} ({reason})") from None
