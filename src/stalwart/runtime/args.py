"""The command line's parser: argparse whose errors are one ConfigError line, which the CLI prints and exits on
(errors.py), instead of argparse's usage dump and exit status 2. One home for every `stalwart` sub-command."""

from __future__ import annotations

import argparse
from typing import NoReturn

from stalwart.errors import ConfigError


class Parser(argparse.ArgumentParser):
    hint = ""
    """Appended to each error (see `pointing_to`)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message}{self.hint}")


def pointing_to(command: str) -> type[Parser]:
    """A Parser whose errors end by pointing to `command --help` (for commands with sub-commands)."""
    return type("Parser", (Parser,), {"hint": f" (see '{command} --help')"})
