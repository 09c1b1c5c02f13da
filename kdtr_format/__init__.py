"""The .kdtr container: spec constants, reader, writer, errors (spec: docs/kdtr-format.md).

    from kdtr_format import write_kdtr, open_kdtr, Tensor, KdtrError
    write_kdtr("model.kdtr", {"w": np.ones((2, 3), np.float32)}, {"seed": 0})
    with open_kdtr("model.kdtr", verify=True) as f:
        w = f["w"]                       # read-only zero-copy view
"""
from kdtr_format.bf16 import bf16_bits, bf16_round, bf16_to_float32
from kdtr_format.errors import (
    AlignmentError, ByteOrderError, ChecksumError, ClosedFileError, DuplicateNameError,
    HeaderChecksumError, HeaderFormatError, HeaderTooLargeError, InvalidBoolError, InvalidDtypeError,
    InvalidNameError, InvalidShapeError, Int4LayoutError, KdtrError, MetadataError, NotAKdtrFileError, NotARegularFileError, OffsetError, OverlapError,
    PaddingError, SafetensorsInputError, ShapeMismatchError, TensorNotFoundError, TrailingDataError, TruncatedFileError,
    UnsupportedVersionError)
from kdtr_format.reader import KdtrFile, TensorInfo, open_kdtr
from kdtr_format.spec import DTYPES
from kdtr_format.writer import Tensor, write_kdtr

__all__ = [
    "write_kdtr", "open_kdtr", "Tensor", "TensorInfo", "KdtrFile", "DTYPES",
    "bf16_bits", "bf16_round", "bf16_to_float32",
    "KdtrError", "NotAKdtrFileError", "UnsupportedVersionError", "ByteOrderError",
    "HeaderTooLargeError", "TruncatedFileError", "TrailingDataError", "HeaderChecksumError",
    "HeaderFormatError", "MetadataError", "InvalidNameError", "DuplicateNameError",
    "InvalidDtypeError", "InvalidShapeError", "ShapeMismatchError", "OffsetError", "OverlapError",
    "AlignmentError", "ChecksumError", "PaddingError", "SafetensorsInputError", "TensorNotFoundError", "ClosedFileError",
    "Int4LayoutError", "InvalidBoolError", "NotARegularFileError",
]
