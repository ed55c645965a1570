"""The one error family for bad SFT input: every message says where, what is wrong, and what to change.

``DataError`` (a ``ValueError``) is what callers catch; the subclasses say which kind of input was bad, so the CLI
can answer any of them with a message and exit code 2 instead of a traceback.
"""

from __future__ import annotations


class DataError(ValueError):
    """Bad SFT data or data settings. ``source``/``line``/``field`` say where (each may be unknown: ``None``)."""

    def __init__(self, problem: str, fix: str, source: str | None = None, line: int | None = None,
                 field: str | None = None) -> None:
        self.problem, self.fix, self.source, self.line, self.field = problem, fix, source, line, field
        super().__init__(f"{self._where()}{problem}. {fix}")

    def _where(self) -> str:
        where = self.source or ""
        if self.line is not None:
            where += f":{self.line}"
        if self.field:
            where += f" field {self.field!r}" if where else f"{self.field}"
        return f"{where}: " if where else ""


class DataFormatError(DataError):
    """A malformed row or file: ``line`` is the line of a .jsonl file, or the 1-based record of a .json array."""

    def __init__(self, source: str, line: int, field: str | None, problem: str,
                 fix: str = "Fix or remove that row") -> None:
        super().__init__(problem, fix, source, line, field)


class DataPathError(DataError, FileNotFoundError):
    """``data_path`` names nothing readable: missing, an unsupported file type, or a folder without data files.

    Also a ``FileNotFoundError``, so code that caught the plain error keeps working.
    """

    def __init__(self, path: str, problem: str, fix: str) -> None:
        super().__init__(problem, fix, source=path)


class EmptyDataError(DataError):
    """Reading and tokenizing left nothing to train on (or nothing to validate on when a split was asked for)."""


class DataSettingError(DataError):
    """A datamodule argument out of range; ``field`` is the argument's name."""

    def __init__(self, field: str, problem: str, fix: str) -> None:
        super().__init__(problem, fix, field=field)
