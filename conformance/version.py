"""The kdtr version: what `kdtr --version` prints and what a bundle's provenance records as its generator."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def kdtr_version() -> str:
    """The installed distribution's version; "0+unknown" when running from a source tree that was never
    installed (so a bundle made there says so rather than claiming a release)."""
    try:
        return version("kdtr")
    except PackageNotFoundError:
        return "0+unknown"
