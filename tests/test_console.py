"""Terminal output prints what it is given: no markup read into notes and paths, no sentence broken."""

from __future__ import annotations

from typing import Any

from stalwart.telemetry.console import console


def test_brackets_in_a_sentence_are_printed_as_they_are(capsys: Any) -> None:
    # rich's markup took "[bench]" for a style tag and dropped it: the bench told users to pip install 'stalwart'.
    line = "torchft is not installed (pip install 'stalwart[bench]' or torchft); run dir /data/run[1]/ckpt"
    console().print(line)
    assert capsys.readouterr().out.strip() == line


def test_a_long_sentence_stays_on_one_line(capsys: Any) -> None:
    line = "delta of step 1 in " + "/very/long/path" * 30
    console().print(line)
    assert capsys.readouterr().out.strip() == line
