"""Input paths on the command line: click.Path, except that a broken symlink says what is wrong with it.

click reports any path that os.stat cannot follow as "does not exist"; for a link that points at itself
(or a ring of links) or at a missing target, that sends the user looking for a file that is there."""
import errno
import os

import click


class InputPath(click.Path):
    """click.Path(exists=True, ...) whose error for a symlink loop or a dangling link names it as such."""

    def __init__(self, **kwargs):
        super().__init__(exists=True, **kwargs)

    def convert(self, value, param, ctx):
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            why = broken_link(os.fspath(value))
            if why is None:
                raise
            self.fail(f"{os.fspath(value)!r} {why}", param, ctx)


def broken_link(path: str) -> str | None:
    """What is wrong with path when it is a symlink that cannot be followed; None otherwise."""
    try:
        os.stat(path)
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return ("is a symbolic link loop (following it leads back to itself); point the link at a real "
                    "file or pass the file's own path")
        if os.path.islink(path):
            return (f"is a symbolic link to {os.readlink(path)!r}, which does not exist; point the link at a "
                    f"real file or pass the file's own path")
        return None
