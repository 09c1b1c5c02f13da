"""The smaller things a reader meets: a broken symlink named as such, a dump judged against the wrong bundle
said in those words, export's two files with one mode, the HTML report without Python reprs and with a
colour per tap, a count line that adds up to the coverage beside it, and console lines that do not wrap at
80 columns in a log."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from cli.main import main
from conformance.records import DUMP_SCHEMA
from conformance.report.html import TAP_COLOURS, svg_plot, write_html
from conformance.report.verdict import CheckResult, Divergence, make_verdict
from kdtr_format import write_kdtr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLE = os.path.join(ROOT, "bundles", "model_int4_tiny.kdtr")
# The bundle judged as its own run dump holds no ddtree_live/ group: its 5 x 5 live DDTree checks do not run.
RAN = "560 of 585 checks ran (25 not run)"


def kdtr(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_a_symlink_loop_and_a_dangling_link_are_named_as_such(tmp_path):
    loop, dangling = tmp_path / "loop.kdtr", tmp_path / "dangling.kdtr"
    loop.symlink_to(loop.name)
    dangling.symlink_to("gone.kdtr")
    r = kdtr("inspect", loop)
    assert r.exit_code == 2 and "is a symbolic link loop" in r.output and "does not exist" not in r.output, r.output
    r = kdtr("verify", dangling)
    assert r.exit_code == 2 and "is a symbolic link to 'gone.kdtr', which does not exist" in r.output, r.output


def test_a_dump_of_another_bundle_is_refused_in_those_words(tmp_path, small_bundle, small_int4_bundle):
    dump = tmp_path / "run.kdtr"
    r = kdtr("verify", small_bundle, "--engine", "reference", "--save-dump", dump)
    assert r.exit_code == 0, r.output
    r = kdtr("verify", small_int4_bundle, "--dump", dump)
    assert r.exit_code == 5, r.output
    assert "this dump was made from another bundle (its bundle_sha256" in r.output
    assert "accepted_offsets" not in r.output                     # not a list of structural problems
    assert kdtr("verify", small_bundle, "--dump", dump).exit_code == 0


def test_a_dump_without_a_bundle_hash_is_matched_by_its_command(tmp_path):
    """An external engine's dump may give only bundle_command (docs/run-dump.md)."""
    dump = tmp_path / "ext.kdtr"
    write_kdtr(dump, {"p0/ar/tokens": np.zeros(2, np.int64)},
               {"schema": DUMP_SCHEMA, "dtype": "float32", "bundle_command": "kdtr gen --out other.kdtr"})
    r = kdtr("verify", BUNDLE, "--dump", dump)
    assert r.exit_code == 5 and "its bundle_command 'kdtr gen --out other.kdtr' is not this bundle's" in r.output


def test_export_writes_both_files_with_the_mode_of_a_new_file(tmp_path):
    r = kdtr("export", os.path.join(ROOT, "tests", "data", "golden_tiny.kdtr"), "--to", tmp_path / "x")
    assert r.exit_code == 0, r.output
    umask = os.umask(0)
    os.umask(umask)
    modes = {n: os.stat(tmp_path / "x" / n).st_mode & 0o777 for n in ("model.safetensors", "metadata.json")}
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_the_html_divergence_panel_shows_values_not_reprs(tmp_path):
    d = Divergence("p0/prefill/L1/q", 1, "q", "prefill", None, 3, (3, 7), 0.5, 0.51,
                   local_error={"max_abs": 0.0032, "passed": False}, inherited_error={"max_abs": 0.01},
                   cause="local", evidence={"rows": [1, 2]})
    v = make_verdict("e", "b.kdtr", [CheckResult("p0/prefill/L1/q", "fail", "numeric", {"max_abs": 0.01},
                                                 {"atol": 1e-3})], d)
    write_html(v, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "{'" not in page and "[1, 2]" not in page and "False" not in page
    assert "max_abs=0.0032, passed=no" in page and "worst index</th><td>3, 7" in page


def test_every_tap_has_its_own_colour_in_the_plots():
    taps = {t: [(0, 0.1), (1, 0.2)] for t in TAP_COLOURS}
    svg = svg_plot("p0/prefill", taps, None)
    assert len(set(TAP_COLOURS.values())) == len(TAP_COLOURS) == 12
    for a, b in (("mlp_in", "mlp_out"), ("resid_attn", "resid_out")):
        assert TAP_COLOURS[a] != TAP_COLOURS[b]
        assert f'fill="{TAP_COLOURS[a]}">{a}</text>' in svg and f'fill="{TAP_COLOURS[b]}">{b}</text>' in svg


def test_the_count_line_adds_up_to_the_coverage_total():
    r = kdtr("verify", BUNDLE, "--dump", BUNDLE)
    line = next(ln for ln in r.output.splitlines() if "coverage (checks run / defined)" in ln)
    passed, failed, not_run, defined = (int(x) for x in re.match(
        r"(\d+) passed, (\d+) failed, (\d+) not run of (\d+) defined; ", line).groups())
    assert passed + failed + not_run == defined and not_run == 25, line
    assert f"(total {passed + failed}/{defined}, " in line and line.endswith(
        "; other checks (integrity, errors, summaries): 2 passed"), line


def test_console_lines_in_a_log_do_not_wrap_at_80_columns(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    bundle = deep / "b.kdtr"
    os.link(BUNDLE, bundle)
    r = subprocess.run([sys.executable, "-m", "cli.main", "verify", str(bundle), "--dump", str(bundle)], cwd=ROOT,
                       env={k: v for k, v in {**os.environ, "PYTHONPATH": ROOT}.items() if k != "COLUMNS"},
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"PASS dump on {bundle}, {RAN}: exit code 0 (OK)" in r.stdout.splitlines()
    assert len(str(bundle)) > 120


@pytest.mark.parametrize("omp, threads", [(None, 1), ("2", 2)])
def test_the_torch_engine_runs_one_cpu_thread_unless_told_and_says_so(omp, threads):
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp:
        env["OMP_NUM_THREADS"] = omp
    code = ("import torch; from conformance.engines.torch_engine import TorchEngine; "
            "e = TorchEngine(device='cpu'); print(torch.get_num_threads()); print(e.describe())")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "PYTHONPATH": ROOT},
                       capture_output=True, text=True)
    n, line = r.stdout.splitlines()
    said = f"cpu ({threads} thread{'s' * (threads != 1)}; OMP_NUM_THREADS sets them)"
    assert int(n) == threads and said in line, r.stdout + r.stderr
