"""One exception per failure mode of a .kdtr file, all subclasses of KdtrError.

Every message names the file, the tensor or field, the bad value and the fix; `kdtr` commands print
it as one line and exit with ExitCode.INVALID_FILE. The reader raises them in the order of the
checks in docs/kdtr-format.md, so a damaged file reports its first (most basic) problem.
"""

# The usual fix for a damaged file: it carries no information worth salvaging by hand.
REGENERATE = "regenerate the file (`kdtr gen ...`, or `kdtr convert` from safetensors)"


class KdtrError(Exception):
    """Base class: the file (or the data given to the writer) violates docs/kdtr-format.md."""


class NotAKdtrFileError(KdtrError):
    """The first 8 bytes are not the kdtr magic, or the file is shorter than the 64-byte preamble."""


class UnsupportedVersionError(KdtrError):
    """The major version is not one this reader implements."""


class ByteOrderError(KdtrError):
    """The byte-order mark is not 0x0A0B0C0D read little-endian."""


class HeaderTooLargeError(KdtrError):
    """header_len is zero or above MAX_HEADER_BYTES."""


class TruncatedFileError(KdtrError):
    """The file ends before header_offset + header_len (it was cut short)."""


class TrailingDataError(KdtrError):
    """Bytes follow the header: the file must end exactly at header_offset + header_len."""


class HeaderChecksumError(KdtrError):
    """The SHA-256 of the header bytes differs from the preamble's: the header was altered."""


class HeaderFormatError(KdtrError):
    """The header is not UTF-8 JSON of the documented shape (types, required or unknown keys)."""


class MetadataError(KdtrError):
    """The metadata block is not a JSON object, or nests deeper than MAX_JSON_DEPTH."""


class InvalidNameError(KdtrError):
    """A tensor name is empty, too long or not printable ASCII."""


class DuplicateNameError(KdtrError):
    """Two tensors share one name."""


class InvalidDtypeError(KdtrError):
    """A dtype outside the dtype table."""


class InvalidShapeError(KdtrError):
    """A shape with too many dims, or a dim that is not a non-negative integer below 2^63."""


class ShapeMismatchError(KdtrError):
    """nbytes differs from dtype size x product(shape), or int4_shape disagrees with the packed shape."""


class OffsetError(KdtrError):
    """A tensor extent lies outside the data section, or leaves a gap the layout rule forbids."""


class OverlapError(KdtrError):
    """A tensor extent starts before the previous one ends."""


class AlignmentError(KdtrError):
    """A tensor offset or the header offset is not a multiple of ALIGNMENT."""


class ChecksumError(KdtrError):
    """A tensor's SHA-256 differs from the directory's: its data was altered."""


class PaddingError(KdtrError):
    """A padding byte between tensors is not zero (found by verify)."""


class SafetensorsInputError(KdtrError):
    """`kdtr convert` was given a file the safetensors library rejects."""


class TensorNotFoundError(KdtrError, KeyError):
    """No tensor of that name in the file."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


class ClosedFileError(KdtrError):
    """The KdtrFile was used after close()."""


class Int4LayoutError(KdtrError, ValueError):
    """INT4 data does not fit the W4A16 layout (docs/int4.md): in a file, int4_shape on a tensor not
    named `.qw`, a `.qw` without int4_shape or without its `.sc`, or a scale whose shape does not
    divide the input dim; in kdtr_format.int4's functions, an array of the wrong shape, dtype or value
    range. One class for both, so `except KdtrError` catches every INT4 failure (also a ValueError:
    a bad array handed to a function is one)."""


class InvalidBoolError(KdtrError):
    """A bool tensor holds a byte other than 0 or 1."""


class NotARegularFileError(KdtrError, OSError):
    """An input path is a FIFO, device, socket or directory, not a regular file (refused before
    reading: a FIFO would block forever)."""

    def __str__(self) -> str:  # OSError would print "[Errno ...]" around a one-argument message
        return str(self.args[0])
