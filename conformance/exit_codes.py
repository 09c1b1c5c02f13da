"""Process exit codes of every `kdtr` command (documented in README.md). Distinct on purpose:
CI can tell a numeric drift from a token flip from a corrupt bundle without parsing output."""
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0               # every check passed
    NUMERIC = 1          # a tap or logits over tolerance
    USAGE = 2            # bad command line (click's own convention)
    TOKENS = 3           # AR token stream differs from the golden stream
    DDTREE = 4           # DDTree stream / rounds / forward counts differ
    INVALID_FILE = 5     # not a kdtr file, corrupt, truncated, checksum mismatch
    ENGINE_ERROR = 6     # the engine under test raised or is unavailable
    COVERAGE = 7         # every check that ran passed, but fewer ran than --require-coverage asks
    INTERRUPTED = 130    # stopped by Ctrl-C (SIGINT): 128 + 2, as shells report a SIGINT death
