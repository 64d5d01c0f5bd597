"""`UserPath`: a path a user writes in a config or a `--set`, with `~` read as the home directory, as the shell
would read it (a YAML string or a `--set` value is not expanded by the shell: `~/runs/x` became a directory
named `~` in the working directory). Every path key of the config has this type."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator

UserPath = Annotated[Path, AfterValidator(Path.expanduser)]
