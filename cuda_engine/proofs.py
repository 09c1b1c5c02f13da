"""GPU proofs: run dumps the CUDA engine wrote on a GPU, committed under bundles/proofs/, that CI (which
has no GPU) re-judges. A proof is valid for today's code only if it was made from today's cuda_engine/
sources: its metadata records their hash (`engine_info.source_hash`), and check_provenance compares it.
Workflow: docs/cuda-engine.md.
"""
from __future__ import annotations

import os
from pathlib import Path

from cuda_engine.build import PACKAGE_DIR, engine_source_hash
from kdtr_format import open_kdtr

REQUIRED = ("device", "compute_capability", "driver", "commit", "source_hash")
REPROVE = ("re-prove on a GPU machine with `bash cuda_engine/device_run.sh OUTDIR` (docs/cuda-engine.md) and "
           "commit OUTDIR/*.cuda.kdtr as bundles/proofs/")


class ProofError(Exception):
    """A GPU proof is missing, lacks its provenance, or was made from other cuda_engine/ sources."""


W4A16_DEFAULT = "fast"


def proof_path(bundle: str | os.PathLike, w4a16: str | None = None) -> Path:
    """bundles/model_tiny.kdtr -> bundles/proofs/model_tiny.cuda.kdtr; an INT4 bundle's proof for a
    non-default --w4a16 mode M: bundles/proofs/model_int4_tiny.cuda-M.kdtr"""
    suffix = ".cuda.kdtr" if w4a16 in (None, W4A16_DEFAULT) else f".cuda-{w4a16}.kdtr"
    return Path(bundle).parent / "proofs" / (Path(bundle).stem + suffix)


def is_int4(bundle: str | os.PathLike) -> bool:
    """Whether the bundle holds INT4 W4A16 weights (its metadata `quantization.method`)."""
    with open_kdtr(bundle) as f:
        return (f.metadata.get("quantization") or {}).get("method") == "w4a16"


def proof_modes(bundle: str | os.PathLike) -> list[str | None]:
    """The --w4a16 modes a bundle is proved in: fast (the default) and plain for INT4 bundles, else none."""
    return [W4A16_DEFAULT, "plain"] if is_int4(bundle) else [None]


def engine_info(proof: str | os.PathLike) -> dict:
    if not Path(proof).exists():
        raise ProofError(f"{proof} does not exist: no GPU proof for this bundle; {REPROVE}")
    with open_kdtr(proof) as f:
        info = f.metadata.get("engine_info") or {}
    missing = [k for k in REQUIRED if k not in info]
    if missing:
        raise ProofError(f"{proof}: metadata engine_info lacks {missing}: not written by the CUDA engine; {REPROVE}")
    return info


def check_provenance(proof: str | os.PathLike, engine_dir: str | os.PathLike = PACKAGE_DIR) -> dict:
    """The proof's engine_info when it was made from the sources now in `engine_dir`; else ProofError."""
    info = engine_info(proof)
    today = engine_source_hash(Path(engine_dir))
    if info["source_hash"] != today:
        raise ProofError(f"{proof} was proved on {info['device']} with cuda_engine/ sources {info['source_hash'][:16]}, "
                         f"but today's sources hash to {today[:16]}: a change under cuda_engine/ was not re-proved "
                         f"on a GPU; {REPROVE}")
    return info


if __name__ == "__main__":                    # cuda_engine/device_run.sh: "MODE PROOF_NAME" per proof of BUNDLE
    import sys

    for _mode in proof_modes(sys.argv[1]):
        print(_mode or "-", proof_path(sys.argv[1], _mode).name)
