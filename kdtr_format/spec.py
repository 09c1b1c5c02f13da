"""Constants of the .kdtr v1 layout (docs/kdtr-format.md is the normative text; keep the two in step).

File layout (all integers little-endian):

    0     8  magic  b"KDTR\\r\\n\\x1a\\n"
    8     2  u16 major version
    10    2  u16 minor version
    12    4  u32 byte-order mark 0x0A0B0C0D (bytes 0D 0C 0B 0A: the file is little-endian)
    16    8  u64 header_offset H (end of the data section, a multiple of ALIGNMENT)
    24    8  u64 header_len N (bytes of UTF-8 JSON)
    32   32  SHA-256 of preamble bytes 0..31 followed by the N header bytes
    64   ..  data section: tensors, each at a multiple of ALIGNMENT, zero padding between
    H     N  header JSON; the file ends exactly at H + N
"""
import struct

import numpy as np

MAGIC = b"KDTR\r\n\x1a\n"      # PNG-style: CR/LF/^Z catch text-mode and line-ending mangling
VERSION_MAJOR = 1              # a reader rejects any other major
VERSION_MINOR = 0              # a higher minor only adds optional JSON keys (see docs)
BYTE_ORDER_MARK = 0x0A0B0C0D   # read back as 0x0D0C0B0A on a big-endian misreading

PREAMBLE = struct.Struct("<8sHHIQQ32s")   # magic, major, minor, bom, header_offset, header_len, sha256
PREAMBLE_SIZE = 64
DIGESTED_PREAMBLE = 32         # bytes 0..31 (all fields but the digest) are hashed with the header
assert PREAMBLE.size == PREAMBLE_SIZE

ALIGNMENT = 64                 # every tensor offset; a cache line and an AVX-512 vector
DATA_START = PREAMBLE_SIZE     # the first tensor starts right after the preamble

# Limits. Each is checked before anything is allocated from it.
MAX_HEADER_BYTES = 64 << 20    # 64 MiB of JSON: ~300k tensor entries
MAX_NDIM = 8
MAX_INT = (1 << 63) - 1        # every dim, offset and nbytes fits a C int64
MAX_NAME_BYTES = 256           # names are printable ASCII 0x20..0x7E
MAX_JSON_DEPTH = 64            # nesting of the whole header document (metadata included)
# Structural characters [ { , : outside strings, counted before parsing: each becomes at most one
# Python object, so this bounds the parser's memory and time. A full K2.6 bundle (139,095 weight
# tensors + 8 prompts of goldens) has 2,474,750; the limit leaves 1.7x (docs/kdtr-format.md).
MAX_JSON_ITEMS = 1 << 22

# name -> (numpy dtype, little-endian, as stored), itemsize follows from it.
# bfloat16 has no numpy dtype: it is stored and returned as its raw uint16 bit pattern.
DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype("<f8"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int16": np.dtype("<i2"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}

# safetensors dtype codes for the same set (export/convert).
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}

INT4_PER_WORD = 8              # an int32 word packs 8 nibbles along the input dim


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """Round n up to a multiple of alignment (Python ints: no overflow)."""
    return -(-n // alignment) * alignment

