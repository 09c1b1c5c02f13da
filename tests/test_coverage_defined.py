"""Coverage is fixed by the bundle (conformance/report/coverage.py): "defined" is computed from the bundle
alone, so a passing and a failing run of one bundle define the same checks, the judge emits exactly those
names, a check an earlier error kept from running counts as not run, a run dump without its `ddtree_live/`
group fails `--require-coverage full` (exit 7), and a run whose checks did not all run never reads as a
plain PASS: its verdict line says how many ran, and its count line adds up to the defined total."""
import numpy as np
import pytest
from click.testing import CliRunner

from cli.main import main
from conformance.engines.faults import FaultyEngine
from conformance.engines.reference_engine import ReferenceEngine
from conformance.exit_codes import ExitCode
from conformance.report.coverage import defined_checks, group_of
from conformance.verify.runner import verify
from kdtr_format import open_kdtr, write_kdtr


@pytest.fixture(scope="module")
def passing(small_bundle):
    return verify(small_bundle, engine=ReferenceEngine())


@pytest.fixture(scope="module")
def dump(small_bundle, tmp_path_factory):
    """The reference engine's run dump: (outputs by name, metadata)."""
    path = tmp_path_factory.mktemp("dump") / "run.kdtr"
    assert verify(small_bundle, engine=ReferenceEngine(), save_dump=str(path)).exit_code == ExitCode.OK
    with open_kdtr(path) as d:
        return {n: np.array(d[n]) for n in d.names}, d.metadata


def defined(v) -> dict:
    return {g: d["defined"] for g, d in v.coverage.items()}


def test_defined_is_the_same_for_a_passing_and_a_failing_run(small_bundle, passing):
    failing = verify(small_bundle, engine=FaultyEngine("swap_expert", 2))
    assert passing.exit_code == ExitCode.OK and failing.exit_code == ExitCode.TOKENS
    assert defined(failing) == defined(passing)
    assert passing.coverage["total"]["run"] == passing.coverage["total"]["defined"]
    # with the AR logits failing, the live trees / path logits checks are of kind numeric: grouped by name,
    # they stay in the ddtree group (grouped by kind, they had dropped out of "defined")
    assert any(c.kind == "numeric" and "/ddtree_live/" in c.name for c in failing.checks)


def test_the_judge_emits_exactly_the_checks_the_bundle_defines(small_bundle, passing):
    with open_kdtr(small_bundle) as f:
        names = [n for group in defined_checks(f).values() for n in group]
    assert sorted(c.name for c in passing.checks if group_of(c.name)) == sorted(names)
    assert sum(n.split("/")[1] == "ddtree_live" for n in names) == 5 * len({n.split("/")[0] for n in names})


class StopsAtDecode(ReferenceEngine):
    name = "stops"

    def decode(self, token, position):
        raise RuntimeError("no decode kernel")


def test_checks_an_engine_error_kept_from_running_count_as_not_run(small_bundle, passing):
    v = verify(small_bundle, engine=StopsAtDecode())
    assert v.exit_code == ExitCode.ENGINE_ERROR
    assert defined(v) == defined(passing) and v.coverage["total"]["run"] == 0


def write(tmp_path, out, meta, leave_out: str) -> str:
    path = tmp_path / "edited.kdtr"
    write_kdtr(path, {k: v for k, v in out.items() if leave_out not in k}, meta)
    return str(path)


def test_a_dump_without_its_live_ddtree_group_fails_full_coverage(small_bundle, dump, tmp_path):
    path = write(tmp_path, *dump, "/ddtree_live/")
    r = CliRunner().invoke(main, ["verify", str(small_bundle), "--dump", path, "--require-coverage", "full"])
    assert r.exit_code == ExitCode.COVERAGE, r.output[-2000:]
    assert "below the required full in ddtree" in r.output and "ddtree_live/tokens (not run" in r.output


def test_a_run_whose_checks_did_not_all_run_says_how_many_ran(small_bundle, dump, passing, tmp_path):
    """A dump without any topk_weights record passes (optional taps are skipped), but never as a plain
    PASS; the count line adds up to the defined total."""
    path = write(tmp_path, *dump, "/topk_weights")
    r = CliRunner().invoke(main, ["verify", str(small_bundle), "--dump", path])
    assert r.exit_code == ExitCode.OK, r.output[-2000:]
    total, lost = passing.coverage["total"]["defined"], sum(n.endswith("/topk_weights") for n in
                                                             (c.name for c in passing.checks))
    assert lost
    last = r.output.strip().splitlines()[-1]
    assert last == (f"PASS dump on {small_bundle}, {total - lost} of {total} checks ran ({lost} not run): "
                    f"exit code 0 (OK)"), last
    counted = next(ln for ln in r.output.splitlines() if " not run of " in ln)
    assert counted.startswith(f"{total - lost} passed, 0 failed, {lost} not run of {total} defined;"), counted
    r = CliRunner().invoke(main, ["verify", str(small_bundle), "--dump", path, "--require-coverage", "full"])
    assert r.exit_code == ExitCode.COVERAGE


def test_a_dump_records_the_steps_kdtr_performed_for_its_run(small_bundle, dump, tmp_path):
    """A dump whose metadata says kdtr compacted the cache in the run that wrote it is judged so; a
    done_by_kdtr that is not an object of strings is an invalid file."""
    out, meta = dump
    path = tmp_path / "steps.kdtr"
    write_kdtr(path, out, {**meta, "done_by_kdtr": {"cache_compaction": "the engine's cache has no compact"}})
    v = verify(small_bundle, dump=str(path))
    assert v.exit_code == ExitCode.OK and [d["step"] for d in v.done_by_kdtr] == ["cache_compaction"]
    assert all(c.status == "skip" for c in v.checks if "/ddtree/" in c.name)
    write_kdtr(path, out, {**meta, "done_by_kdtr": ["cache_compaction"]})
    v = verify(small_bundle, dump=str(path))
    assert v.exit_code == ExitCode.INVALID_FILE
    assert "metadata done_by_kdtr ['cache_compaction']: must be an object" in v.checks[-1].message
