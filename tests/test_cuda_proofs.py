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


def _git(*args, **kw):
    import subprocess

    return subprocess.run(["git", "-C", str(PACKAGE_DIR.parent), *args], capture_output=True, **kw)


def _sources_at(commit: str, tmp_path):
    """cuda_engine/ as commit `commit` holds it, extracted under tmp_path (None: no such commit here)."""
    import io
    import tarfile

    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        return None
    tar = _git("archive", commit, "cuda_engine", check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(tmp_path, filter="data")
    return tmp_path / "cuda_engine"


@pytest.mark.parametrize("bundle,mode", PROOFS)
def test_proof_names_the_commit_it_was_made_from(bundle, mode, tmp_path):
    """A proof's commit is provenance a reader follows: it must be a commit of this repository whose cuda_engine/
    is the one the proof ran (its source hash). A commit typed wrong, or read from a stale checkout on the GPU
    machine, fails here. Needs the history: a shallow clone cannot tell, and skips."""
    from cuda_engine.build import engine_source_hash

    if _git("rev-parse", "--is-shallow-repository").stdout.strip() != b"false":
        pytest.skip("not a full git clone: the proofs' commits cannot be looked up")
    info = engine_info(proof_path(bundle, mode))
    at = _sources_at(info["commit"], tmp_path)
    assert at is not None, (f"{proof_path(bundle, mode)} names commit {info['commit']!r}, which this repository "
                            f"does not have; re-prove with KDTR_COMMIT=$(git rev-parse HEAD) taken where the "
                            f"commit was made")
    assert engine_source_hash(at) == info["source_hash"], (
        f"{proof_path(bundle, mode)} names commit {info['commit'][:12]}, whose cuda_engine/ is not the one the "
        f"proof ran (source hash {info['source_hash'][:12]}): the commit was taken from another checkout")


def test_a_wrong_commit_is_caught(tmp_path):
    """The check above on what it must refuse: a commit that does not exist, and one whose cuda_engine/ differs
    (the first commit that has cuda_engine/ certainly differs from today's)."""
    from cuda_engine.build import engine_source_hash

    if _git("rev-parse", "--is-shallow-repository").stdout.strip() != b"false":
        pytest.skip("not a full git clone")
    assert _sources_at("0" * 40, tmp_path / "a") is None
    first = _git("log", "--format=%H", "--reverse", "--", "cuda_engine/kernels", check=True).stdout.split()[0]
    old = _sources_at(first.decode(), tmp_path / "b")
    assert old is not None and engine_source_hash(old) != engine_source_hash(PACKAGE_DIR)


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
