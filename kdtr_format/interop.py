"""safetensors <-> .kdtr, bit-exact for every kdtr dtype (bfloat16 travels as raw 16-bit words).

export: the kdtr file is verified, then its mmapped tensors are handed to the safetensors library's
own writer by pointer (no copy); the kdtr metadata and INT4 logical shapes ride along as JSON strings
in safetensors' `__metadata__` (keys `kdtr.metadata`, `kdtr.int4_shapes`, `kdtr.order`), and the metadata is also
written as a plain JSON file. convert: the safetensors library validates the file, then its tensors
are streamed by mmap into write_kdtr in file (offset) order; for a file that came from `export` the
metadata, INT4 shapes and tensor order are restored, so kdtr -> safetensors -> kdtr is byte-identical.
"""
import json
import mmap
import os
import stat
import struct

import numpy as np
import safetensors

from kdtr_format import spec
from kdtr_format.errors import InvalidDtypeError, MetadataError, SafetensorsInputError
from kdtr_format.paths import check_regular, write_atomically
from kdtr_format.reader import open_kdtr
from kdtr_format.writer import Tensor, write_kdtr

ST_FILE = "model.safetensors"
META_FILE = "metadata.json"
META_KEY, INT4_KEY, ORDER_KEY = "kdtr.metadata", "kdtr.int4_shapes", "kdtr.order"
_KDTR_BY_ST = {code: name for name, code in spec.SAFETENSORS_DTYPES.items()}


def export_safetensors(kdtr_path, out_dir) -> tuple[str, str]:
    """Write out_dir/model.safetensors and out_dir/metadata.json; return both paths."""
    st_path, meta_path = os.path.join(out_dir, ST_FILE), os.path.join(out_dir, META_FILE)
    with open_kdtr(kdtr_path, verify=True) as f:   # first: a bad input creates no directory
        os.makedirs(out_dir, exist_ok=True)
        views = {name: f[name] for name in f}  # keep every view alive while safetensors reads them
        specs = {name: safetensors.TensorSpec(dtype=f.info(name).dtype, shape=list(v.shape),
                                              data_ptr=v.ctypes.data if v.nbytes else 0,
                                              data_len=v.nbytes)
                 for name, v in views.items()}
        int4 = {n: list(f.info(n).int4_shape) for n in f if f.info(n).int4_shape is not None}
        st_meta = {META_KEY: _dumps(f.metadata), INT4_KEY: _dumps(int4), ORDER_KEY: _dumps(f.names)}
        # The library writes by name; fh.name is the temp file, flushed and fsync'd after. It creates its
        # file 0600 whatever the umask: given the mode the metadata file gets (or the replaced file's).
        mode = _mode_for(st_path)

        def write(fh):
            safetensors.serialize_file(specs, fh.name, st_meta)
            os.chmod(fh.name, mode)
        write_atomically(st_path, write)
        metadata = f.metadata
        del views, specs
    text = json.dumps(metadata, indent=2, sort_keys=True) + "\n"
    write_atomically(meta_path, lambda fh: fh.write(text.encode("utf-8")))
    return st_path, meta_path


def _mode_for(path: str) -> int:
    """The permission bits `path` keeps (it exists) or gets as a new file (0666 minus the umask)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def convert_safetensors(st_path, out_path) -> None:
    """Write the tensors of a safetensors file to out_path as .kdtr (streamed, atomic)."""
    st_path = os.fspath(st_path)
    check_regular(st_path, "safetensors file")   # a FIFO would block the safetensors reader
    try:
        with safetensors.safe_open(st_path, framework="np") as sf:  # validates the whole header
            st_meta = sf.metadata() or {}
            declared = {k: (sf.get_slice(k).get_dtype(), sf.get_slice(k).get_shape()) for k in sf.keys()}
    except (safetensors.SafetensorError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise SafetensorsInputError(f"{st_path}: not a valid safetensors file ({e}); pass a "
                                    f"safetensors file") from None
    for name, (code, _) in declared.items():
        if code not in _KDTR_BY_ST:
            raise InvalidDtypeError(
                f"{st_path}: tensor '{name}': safetensors dtype {code} has no kdtr equivalent; "
                f"cast it to one of {', '.join(spec.SAFETENSORS_DTYPES.values())} first")
    metadata, int4, order = _kdtr_metadata(st_path, st_meta)
    with open(st_path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        n = struct.unpack("<Q", mm[:8])[0]
        header = json.loads(mm[8:8 + n])
        base = 8 + n
        if sorted(order) != sorted(declared):  # not from `kdtr export`: keep the file's data order
            order = sorted(declared, key=lambda k: header[k]["data_offsets"][0])

        def tensors():
            for name in order:
                dtype = _KDTR_BY_ST[declared[name][0]]
                begin, end = header[name]["data_offsets"]
                np_dtype = spec.DTYPES[dtype]
                view = np.frombuffer(mm, np_dtype, count=(end - begin) // np_dtype.itemsize,
                                     offset=base + begin).reshape(declared[name][1])
                yield name, Tensor(view, dtype=dtype, int4_shape=int4.get(name))
                del view  # the mmap can only close once no view is left

        write_kdtr(out_path, tensors(), metadata)


def _kdtr_metadata(st_path: str, st_meta: dict) -> tuple[dict, dict, list]:
    """(metadata, int4 shapes, tensor order): restored from an export, else the safetensors strings
    kept as metadata."""
    if META_KEY not in st_meta:
        return {"safetensors_metadata": dict(sorted(st_meta.items()))}, {}, []
    try:
        metadata = json.loads(st_meta[META_KEY])
        int4 = {k: tuple(v) for k, v in json.loads(st_meta.get(INT4_KEY, "{}")).items()}
        order = [str(n) for n in json.loads(st_meta.get(ORDER_KEY, "[]"))]
    except (ValueError, TypeError, AttributeError) as e:
        raise MetadataError(f"{st_path}: __metadata__ key {META_KEY!r} or {INT4_KEY!r} is not the "
                            f"JSON `kdtr export` writes ({e}); remove the key or re-export") from None
    if not isinstance(metadata, dict):
        raise MetadataError(f"{st_path}: __metadata__[{META_KEY!r}] is not a JSON object; remove "
                            f"the key or re-export")
    return metadata, int4, order


def _dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
