"""The errors litft raises on purpose, each with its exit code (docs/design.md).

Every one carries a message that says what failed, where (file/line, dotted key, step, rank) and what to try.
The CLI prints that message and exits with ``exit_code``; Python users catch the class.
"""

from __future__ import annotations


class LitftError(Exception):
    """Base class; an unexpected failure that is not one of the kinds below exits 1."""

    exit_code = 1
    kind = "error"


class ConfigError(LitftError):
    """Usage or config error: unknown key, wrong type or choice, contradictory settings (exit 2).

    ``problems`` holds every problem found, so the user fixes them all in one round.
    """

    exit_code = 2
    kind = "config error"

    def __init__(self, problems: list[str] | str, source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        where = f"{source}: " if source else ""
        if len(self.problems) == 1:
            text = f"{where}{self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            text = f"{where}{len(self.problems)} problems:\n{lines}"
        super().__init__(text)


class NonFiniteLossError(LitftError):
    """The loss (or gradient norm) became NaN/Inf; raised before the optimizer step (exit 3)."""

    exit_code = 3
    kind = "non-finite loss"


class OutOfMemoryError(LitftError):
    """The device ran out of memory (exit 4). The message names the batch shape and what would help."""

    exit_code = 4
    kind = "out of memory"


class DataError(LitftError):
    """The data set cannot be read or is malformed (exit 5). Raised before the model loads."""

    exit_code = 5
    kind = "data error"


class CheckpointError(LitftError):
    """A checkpoint is missing, truncated or corrupt, or it cannot be written (exit 6)."""

    exit_code = 6
    kind = "checkpoint error"
