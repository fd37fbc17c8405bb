"""`packserve bench` without the bench extra says what to install, and runs nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from packserve.cli import main


def test_a_missing_extra_is_named_with_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    assert main(["bench", "trace", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "pip install 'packserve[bench]'" in err
    assert list(tmp_path.iterdir()) == []  # nothing ran
