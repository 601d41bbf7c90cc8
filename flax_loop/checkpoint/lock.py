r"""One writer per kind of checkpoint file in a directory, across processes.

Two runs writing the same files into one directory delete each other's
newer files. A writer therefore holds an advisory lock (`fcntl.flock`) on a
lock file per file prefix while it is open; a second writer waits briefly
(a restarted job's old process may be finishing its last write), then
raises naming the holder. The lock is released when the writer closes, or
by the operating system when its process ends, however it ends.
"""

import errno
import fcntl
import os
import socket
import stat
import time
from typing import IO

from flax_loop.errors import CheckpointError

LOCK_PREFIX = ".lock."
WAIT_SECONDS = 10.0
r"""How long a writer waits for another writer of the same files to finish."""


def lock_path(directory: str, prefix: str) -> str:
    r"""The lock file of the checkpoint files `prefix*` in `directory`."""
    return os.path.join(directory, f"{LOCK_PREFIX}{prefix}lock")


class DirectoryLock:
    r"""An exclusive lock on a directory's checkpoint files of one prefix.

    >>> import pathlib, tempfile
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> lock = DirectoryLock(str(tmp), "regular.")
    >>> lock.acquire()
    >>> DirectoryLock(str(tmp), "regular.").acquire(wait_seconds=0)
    Traceback (most recent call last):
    ...
    flax_loop.errors.CheckpointError: Another checkpoint writer is writing ...
    >>> lock.release()
    """

    def __init__(self, directory: str, prefix: str) -> None:
        self.path = lock_path(directory, prefix)
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        r"""whether this object holds the lock."""
        return self._file is not None

    def acquire(self, wait_seconds: float | None = None) -> None:
        r"""Takes the lock, waiting up to `wait_seconds` (`WAIT_SECONDS` by default).

        Raises:
            CheckpointError: naming the holder (host and process id) if the
                lock stays taken.
        """
        if self._file is not None:
            return
        deadline = time.monotonic() + (WAIT_SECONDS if wait_seconds is None else wait_seconds)
        file = _open_lock_file(self.path)
        while True:
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    file.seek(0)
                    holder = file.read(200).strip() or "unknown"
                    file.close()
                    raise CheckpointError(
                        f"Another checkpoint writer is writing the same files in "
                        f"{os.path.dirname(self.path)!r} ({holder}; lock file "
                        f"{self.path}). Two runs sharing a directory delete each other's "
                        "files: give this run another output_dir, or stop the other "
                        "writer (close() it, or end its process) first."
                    ) from None
                time.sleep(0.05)
        file.seek(0)
        file.truncate()  # ours: a regular file of the directory, linked nowhere else
        file.write(f"host {socket.gethostname()}, process id {os.getpid()}\n")
        file.flush()
        self._file = file

    def release(self) -> None:
        r"""Releases the lock (closing the file releases it)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def _open_lock_file(path: str) -> IO[str]:
    r"""The lock file, created if absent, opened without following a symbolic
    link and without truncating: a link planted under the lock file's name
    must never lead the writer to overwrite a file elsewhere."""
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise CheckpointError(
                f"The lock file {path!r} is a symbolic link: flax_loop never writes "
                "through one. Remove it (the directory's writer creates its own)."
            ) from error
        raise CheckpointError(f"Cannot create the lock file {path!r}: {error}.") from None
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1:
        os.close(descriptor)
        what = (
            "a file with other names (hard links)" if stat.S_ISREG(status.st_mode) else "not a file"
        )
        raise CheckpointError(
            f"The lock file {path!r} is {what}: flax_loop writes only a lock "
            "file of its own. Remove it (the directory's writer creates its own)."
        )
    return os.fdopen(descriptor, "r+")
