r"""Running CRC32s of a checkpoint file's arrays, summed beside its reads
and writes (`Checksums`), in chunks of `CHUNK` bytes."""

import queue
import threading
import zlib
from typing import Any

CHUNK = 8 << 20
r"""The bytes a file's array is read, written and summed in at a time."""


class Checksums:
    r"""Running CRC32s computed on a worker thread, overlapping file I/O.

    `zlib.crc32` and file reads and writes release the GIL, so checksumming
    chunk k while chunk k + 1 is read or written takes the time of the slower
    of the two, not of both (benchmarks/checkpoint_io.py).
    A plain thread, not an executor: background writes may run while the
    interpreter exits, when executors no longer accept work. The thread
    starts with the first full chunk: a file of small arrays is summed
    where it is read (handing each to a thread cost more than summing it).

    >>> with Checksums() as checksums:
    ...     for chunk in (b"flax", b"_loop"):
    ...         checksums.add(memoryview(chunk))
    ...     crc = checksums.result()    # of the chunks added since the last result
    >>> crc == zlib.crc32(b"flax_loop")
    True
    """

    _END = object()

    def __init__(self) -> None:
        self._chunks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._here = 0  # the running checksum while no thread runs

    def _run(self, checksum: int) -> None:
        while (chunk := self._chunks.get()) is not None:
            if chunk is self._END:
                self._results.put(checksum)
                checksum = 0
            else:
                try:
                    checksum = zlib.crc32(chunk, checksum)
                except BaseException as error:  # hand it to the caller of result()
                    checksum = error  # type: ignore[assignment]

    def add(self, chunk: memoryview) -> None:
        if self._thread is None:
            if len(chunk) < CHUNK:
                self._here = zlib.crc32(chunk, self._here)
                return
            self._thread = threading.Thread(
                target=self._run, args=(self._here,), name="flax_loop-crc32", daemon=True
            )
            self._thread.start()
        self._chunks.put(chunk)

    def result(self) -> int:
        if self._thread is None:
            value, self._here = self._here, 0
            return value
        self._chunks.put(self._END)
        value = self._results.get()
        if isinstance(value, BaseException):
            raise value
        return int(value)

    def __enter__(self) -> "Checksums":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._chunks.put(None)
            self._thread.join()
