"""The error every data reader raises: it names the file and the frame."""

from __future__ import annotations

import os


class StructureError(ValueError):
    """A structure file or frame is unusable. ``path`` and ``frame`` say where."""

    def __init__(self, path: str | os.PathLike | None, frame: int | None, message: str):
        self.path = None if path is None else str(path)
        self.frame = frame
        self.reason = message
        where = self.path or "<structures>"
        if frame is not None:
            where += f", frame {frame}"
        super().__init__(f"{where}: {message}")

    def __reduce__(self):  # crosses process boundaries (prepare's workers) intact
        return (StructureError, (self.path, self.frame, self.reason))
