"""A valid .kdtr file with one more tensor declared, its bytes a hole: a sparse file that declares far more
data than the disk holds (the hostile-bundle tests: a 1 TiB tensor costs a few KiB of disk)."""
import hashlib
import json
import struct

from kdtr_format import spec


def with_sparse_tensor(src, dst, name: str, nbytes: int, sha256: str = "0" * 64) -> None:
    """Copy `src` to `dst` with a uint8 tensor `name` of `nbytes` zero bytes appended to the directory and
    the data section; the header is re-sealed (valid digest), so the file opens cleanly. `sha256` is the
    directory's checksum for it (the real one of nbytes zeros takes as long to compute as to check)."""
    data = open(src, "rb").read()
    hoff = struct.unpack_from("<Q", data, 16)[0]
    doc = json.loads(data[hoff:])
    doc["tensors"].append({"name": name, "dtype": "uint8", "shape": [nbytes], "offset": hoff,
                           "nbytes": nbytes, "sha256": sha256})
    new_hoff = spec.align_up(hoff + nbytes)
    header = json.dumps(doc).encode()
    fields = data[:16] + struct.pack("<QQ", new_hoff, len(header))
    with open(dst, "wb") as fh:
        fh.write(fields + hashlib.sha256(fields + header).digest() + data[64:hoff])
        fh.seek(new_hoff)
        fh.write(header)
