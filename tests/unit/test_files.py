"""``files.atomic_dir``: a folder is replaced whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.files import atomic_dir


def test_a_folder_is_replaced_whole_or_not_at_all(tmp_path: Path) -> None:
    target = tmp_path / "out"
    for version in ("1", "2"):
        with atomic_dir(target) as tmp:
            assert tmp == tmp_path / "out.tmp" and tmp.is_dir() and not any(tmp.iterdir())
            (tmp / "v").write_text(version)
            assert not target.exists() or (target / "v").read_text() != version
        assert (target / "v").read_text() == version
    with pytest.raises(OSError, match="disk full"), atomic_dir(target) as tmp:
        (tmp / "v").write_text("3")
        raise OSError("disk full")
    assert (target / "v").read_text() == "2"  # the previous folder, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing half-written left


def test_hidden_staging_and_a_leftover_of_a_dead_writer(tmp_path: Path) -> None:
    target = tmp_path / "env"
    (tmp_path / ".env.tmp").mkdir()
    (tmp_path / ".env.tmp" / "stale").write_text("a build that died")
    with atomic_dir(target, hidden=True, create=False) as tmp:
        assert tmp == tmp_path / ".env.tmp" and not tmp.exists()  # the leftover is gone
        tmp.mkdir()
        (tmp / "marker").write_text("ok")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env"]
    assert sorted(p.name for p in target.iterdir()) == ["marker"]
