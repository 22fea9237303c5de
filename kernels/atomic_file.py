"""Cache files that a reader never sees half-written: write a temporary file beside the target, then rename."""
from __future__ import annotations

import os
import tempfile


def write_atomically(path: str, data: bytes) -> None:
    """Put `data` at `path` through a temporary file in the same folder and os.replace (atomic on POSIX and
    Windows). The temporary file is removed when anything fails, and the error is raised to the caller."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
