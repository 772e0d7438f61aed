"""Terminal output for people that never breaks a phrase: the same words at any width, tty or pipe.

rich wraps text to the terminal's width (80 columns when it cannot tell, e.g. under pytest or in a pipe), so a
long path in a sentence used to push "delta of step 1" onto two lines. Sentences are printed soft-wrapped (one
line; the terminal folds it), and tables get the real width on a terminal and room enough elsewhere.
"""

from __future__ import annotations

import sys

from rich.console import Console

PIPE_WIDTH = 200
"""Columns for tables when the output is not a terminal (a log, a pipe, a test's capture)."""


def console(*, stderr: bool = False) -> Console:
    """A rich Console for stalwart's commands: no highlighting of numbers, no wrapping of sentences, and no
    markup: what is printed is printed as it is (a path or a note with brackets, "pip install 'stalwart[bench]'",
    lost its bracketed part as a style tag); colour comes from rich Text objects."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else PIPE_WIDTH
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=width, markup=False)
