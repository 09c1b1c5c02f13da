"""What `kdtr inspect` shows of a .kdtr file: its layout, metadata and directory as one JSON-able dict."""
from kdtr_format.reader import open_kdtr


def describe(path, check: bool = False) -> dict:
    """A JSON-able summary of a file (what `kdtr inspect` shows); check=True verifies every checksum."""
    with open_kdtr(path, verify=check) as f:
        tensors = [{"name": i.name, "dtype": i.dtype, "shape": list(i.shape), "offset": i.offset,
                    "nbytes": i.nbytes, "sha256": i.checksum,
                    "int4_shape": list(i.int4_shape) if i.int4_shape is not None else None}
                   for i in (f.info(n) for n in f.names)]
        return {"path": f.path, "version": f"{f.version[0]}.{f.version[1]}",
                "file_size": f.file_size, "header_offset": f.header_offset,
                "header_len": f.header_len, "header_sha256": f.header_sha256,
                "data_bytes": sum(t["nbytes"] for t in tensors), "checked": check,
                "metadata": f.metadata, "tensors": tensors}
