"""`python -m benchmarks` without the benchmarks' own dependencies says what installs them, and
runs nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from benchmarks import main


def test_a_missing_dependency_is_named_with_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    assert main(["trace", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "need matplotlib" in err and "scripts/setup.sh --dev" in err
    assert list(tmp_path.iterdir()) == []  # nothing ran
