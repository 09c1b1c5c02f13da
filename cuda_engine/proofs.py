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

PROOF_DIR = Path("bundles") / "proofs"
REQUIRED = ("device", "compute_capability", "driver", "commit", "source_hash")
REPROVE = ("re-prove on a GPU machine with `bash cuda_engine/device_run.sh OUTDIR` (docs/cuda-engine.md) and "
           "commit OUTDIR/*.cuda.kdtr as bundles/proofs/")


class ProofError(Exception):
    """A GPU proof is missing, lacks its provenance, or was made from other cuda_engine/ sources."""


def proof_path(bundle: str | os.PathLike) -> Path:
    """bundles/model_tiny.kdtr -> bundles/proofs/model_tiny.cuda.kdtr"""
    return Path(bundle).parent / "proofs" / (Path(bundle).stem + ".cuda.kdtr")


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
