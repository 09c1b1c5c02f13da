"""compact(start, keep)'s argument check, shared by the torch engines (conformance/engines/protocol.py):
every bad argument is refused naming its value; a valid accepted path comes back as int64."""
import re

import numpy as np
import pytest

from conformance.engines.protocol import compact_keep


def test_an_accepted_path_passes_as_int64():
    keep = compact_keep(5, [0, 2, 3], 9)
    assert keep.dtype == np.int64 and keep.tolist() == [0, 2, 3]
    assert compact_keep(9, [], 9).size == 0                    # nothing accepted past the end: fine


@pytest.mark.parametrize("start, keep, length, said", [
    (-1, [0], 9, "start=-1 must be in [0, length=9]"),
    (10, [], 9, "start=10 must be in [0, length=9]"),
    (5, [0, 4], 9, "keep indices [0, 4] must be in [0, 4)"),
    (5, [-1], 9, "keep indices [-1] must be in [0, 4)"),
    (2, [1, 1], 9, "keep [1, 1] must be strictly increasing"),
    (2, [3, 0], 9, "keep [3, 0] must be strictly increasing"),
])
def test_bad_arguments_are_refused_naming_them(start, keep, length, said):
    with pytest.raises(ValueError, match="compact: " + re.escape(said)):
        compact_keep(start, keep, length)
