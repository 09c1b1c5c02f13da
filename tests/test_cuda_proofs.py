"""GPU proofs on the CPU: every committed bundle has a CUDA-engine run dump made on a GPU
(bundles/proofs/), kdtr re-judges it and it passes, and it was made from today's cuda_engine/ sources
(a kernel change that was not re-proved fails here, with how to re-prove). No GPU, no pycuda."""
import json
import shutil

import pytest
from click.testing import CliRunner

from cli.main import main
from conformance.records import prompts_of
from conformance.verify.outputs import LIVE, LIVE_RECORDS
from cuda_engine.build import PACKAGE_DIR
from cuda_engine.proofs import REPROVE, ProofError, check_provenance, engine_info, proof_modes, proof_path
from kdtr_format import open_kdtr

from cuda_oracle import committed_bundles

BUNDLES = committed_bundles()
PROOFS = [(b, m) for b in BUNDLES for m in proof_modes(b)]      # INT4 bundles: one proof per --w4a16 mode
# The live DDTree checks that must pass in a CUDA proof's verdict (conformance/verify/judge_live.py; path_logits as
# the replay's): the engine's own drafter, trees and forward count, judged.
LIVE_CHECKS = ("tokens", "tokens_vs_own_ar", "trees", "target_forwards", "path_logits")


def test_int4_bundles_are_proved_in_both_w4a16_modes():
    assert any(m == "plain" for _, m in PROOFS) and any(m == "fast" for _, m in PROOFS), PROOFS


@pytest.mark.parametrize("bundle,mode", PROOFS)
def test_proof_passes_the_bundle(bundle, mode, tmp_path):
    """The proof passes, and it proves the engine's own DDTree too: `ddtree_live/` records are optional in a
    run dump (an engine without its own loop omits them), so a proof made without them would pass the rest.
    The CUDA engine has `ddtree_generate`: its proof holds every live record of every prompt and its verdict
    the live checks, run."""
    proof = proof_path(bundle, mode)
    info = engine_info(proof)                                     # exists, written by the CUDA engine
    assert info.get("w4a16") == mode, f"{proof} was run with --w4a16 {info.get('w4a16')}, expected {mode}"
    with open_kdtr(bundle) as f:
        prompts = prompts_of(f)
    with open_kdtr(proof) as d:
        names = set(d.names)
    missing = [f"p{i}/{LIVE}/{k}" for i in prompts for k in LIVE_RECORDS if f"p{i}/{LIVE}/{k}" not in names]
    assert not missing, (f"{proof} lacks {len(missing)} live DDTree records ({', '.join(missing[:4])}, ...): it "
                         f"was not made by `kdtr verify --engine cuda --save-dump`, whose ddtree_generate writes "
                         f"them; {REPROVE}")
    report = tmp_path / "proof.json"
    r = CliRunner().invoke(main, ["verify", bundle, "--dump", str(proof), "--json", str(report)])
    assert r.exit_code == 0, f"the GPU proof {proof} no longer passes {bundle}:\n{r.output}"
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    for name in (f"p{i}/{LIVE}/{check}" for i in prompts for check in LIVE_CHECKS):
        c = checks.get(name, {"status": "absent", "message": "not in the JSON report's checks"})
        assert c["status"] == "pass", (f"{proof}: the live DDTree check {name} is {c['status']} in the verdict, "
                                       f"expected pass ({c.get('message')})")


@pytest.mark.parametrize("bundle,mode", PROOFS)
def test_proof_was_made_from_todays_sources(bundle, mode):
    info = check_provenance(proof_path(bundle, mode))
    assert info["compute_capability"] in ("9.0", "12.0") and info["driver"] and info["commit"]


def test_one_changed_byte_in_a_kernel_fails_the_proof(tmp_path):
    proof = proof_path(BUNDLES[0])
    copy = tmp_path / "cuda_engine"
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns(".build", "__pycache__"))
    check_provenance(proof, copy)                                 # an exact copy still matches
    src = copy / "kernels" / "linear.cu"
    data = bytearray(src.read_bytes())
    data[-2] ^= 0x01                                              # one byte of one kernel
    src.write_bytes(bytes(data))
    with pytest.raises(ProofError, match=r"a change under cuda_engine/ was not re-proved on a GPU; re-prove on a "
                                         r"GPU machine with `bash cuda_engine/device_run.sh OUTDIR`"):
        check_provenance(proof, copy)


def test_missing_proof_says_how_to_prove(tmp_path):
    with pytest.raises(ProofError, match=r"does not exist: no GPU proof for this bundle; re-prove"):
        engine_info(tmp_path / "none.cuda.kdtr")
