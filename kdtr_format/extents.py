"""Reading byte extents of an open file that another process may change, truncate or extend meanwhile.

A memory-mapped page whose file was truncated under the mapping kills the reader with SIGBUS: no
message, no exit code, and Python cannot catch it. Everything here reads with `os.pread` instead: a
file that shrinks gives a short read, which becomes a TruncatedFileError naming the file, and a file
whose size or modification time differs from when it was opened becomes a FileChangedError. Both are
KdtrErrors (exit code 5). Hashing reads a fixed-size chunk at a time into one reused buffer, so its
memory does not grow with the tensor (a declared 1 TiB tensor costs one chunk of memory, not 1 TiB of
resident mapped pages) and it can report progress as it goes.
"""
from __future__ import annotations

import hashlib
import os
from typing import Callable

from kdtr_format.errors import FileChangedError, TruncatedFileError

CHUNK = 8 << 20      # bytes per pread while hashing: large enough for ~1 GB/s SHA-256, small enough to ignore
_RETRY = "wait until whatever writes it has finished (or use a fresh copy), then run again"


class FileWatch:
    """An open file's descriptor and what it looked like when opened (size, mtime), so that every read
    can tell a file changed under it from a corrupt one."""

    def __init__(self, fd: int, path: str):
        st = os.fstat(fd)
        self.fd, self.path, self.size, self.mtime_ns = fd, path, st.st_size, st.st_mtime_ns

    def check(self) -> None:
        """Raise TruncatedFileError if the file is now shorter than when opened, FileChangedError if its
        size or modification time differs."""
        st = os.fstat(self.fd)
        if st.st_size < self.size:
            raise TruncatedFileError(
                f"{self.path}: truncated while being read ({st.st_size} bytes now, {self.size} when it was "
                f"opened): another process is writing or cutting it; {_RETRY}")
        if st.st_size != self.size or st.st_mtime_ns != self.mtime_ns:
            raise FileChangedError(
                f"{self.path}: changed while being read (size {self.size} -> {st.st_size} bytes, or its "
                f"modification time moved): another process is writing it; {_RETRY}")

    def pread_into(self, view: memoryview, offset: int) -> None:
        """Fill `view` from `offset`; a short read (the file shrank) is a TruncatedFileError."""
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                self.check()                         # names how it changed
                raise TruncatedFileError(            # same size and mtime, yet no bytes: still cut short
                    f"{self.path}: ends at byte {offset + done} while reading up to {offset + len(view)}; "
                    f"{_RETRY}")
            done += n

    def read(self, offset: int, nbytes: int) -> bytearray:
        """A private copy of bytes [offset, offset + nbytes)."""
        buf = bytearray(nbytes)
        self.pread_into(memoryview(buf), offset)
        return buf

    def sha256(self, offset: int, nbytes: int, progress: Callable[[int], None] | None = None,
               buf: bytearray | None = None) -> str:
        """SHA-256 hex of the extent, CHUNK bytes at a time through one buffer; progress(n) after each chunk."""
        h = hashlib.sha256()
        buf = buf if buf is not None else bytearray(min(CHUNK, max(nbytes, 1)))
        view = memoryview(buf)
        done = 0
        while done < nbytes:
            n = min(len(view), nbytes - done)
            self.pread_into(view[:n], offset + done)
            h.update(view[:n])
            done += n
            if progress:
                progress(n)
        return h.hexdigest()
