"""`kdtr gen` at the desk: strict options, presets listed, a readable summary, progress lines in a log, free
space checked before the work, the corpus sized by the run (bench/bench_gen_small.py times the small run)."""
import os

from click.testing import CliRunner

from cli.main import main
from refmodel.config import PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gen_help_lists_the_presets_and_explains_max_new_tokens():
    r = CliRunner().invoke(main, ["gen", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    assert "[" + "|".join(sorted(PRESETS)) + "]" in r.output
    assert "--max-new-tokens INTEGER RANGE Greedy tokens generated per prompt" in " ".join(r.output.split())


def test_gen_summary_is_a_table_of_plain_values(tmp_path):
    """Nested figures as their own rows, lists as numbers: no Python dict or list repr in the summary."""
    r = CliRunner().invoke(main, ["gen", "--prompt-ids", "5,6", "--max-new-tokens", "3", "--distill-steps", "0",
                                  "--bf16-profile", "no", "--long-position", "100", "--out", str(tmp_path / "b.kdtr")])
    assert r.exit_code == 0, r.output
    assert "{" not in r.output and "[" not in r.output and "'" not in r.output, r.output
    rows = {ln.strip("│ ").split("│")[0].strip(): ln for ln in r.output.splitlines() if "│" in ln}
    assert "long position: position offset" in rows and " 100 " in rows["long position: position offset"]
    assert "accepted depth histogram" in rows
    assert "progress" not in r.output


def test_gen_progress_is_lines_in_a_log(tmp_path):
    """stderr not a terminal: a line per stage start, tenth and end, readable while the run goes on."""
    import subprocess
    import sys
    log = tmp_path / "log"
    with open(log, "w") as fh:
        subprocess.run([sys.executable, "-m", "cli.main", "gen", "--prompt-ids", "5,6", "--max-new-tokens", "3",
                        "--distill-steps", "0", "--bf16-profile", "no", "--long-position", "0",
                        "--out", str(tmp_path / "b.kdtr")], cwd=ROOT, stderr=fh, stdout=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": ROOT}, check=True)
    lines = log.read_text().splitlines()
    assert any(ln.endswith("goldens: 1/1 done") for ln in lines), lines
    assert lines[0].startswith("bundle of about ") and all(" s  " in ln for ln in lines[1:]), lines


def test_the_size_estimate_bounds_the_bundle_from_above(small_bundle):
    """The free-space check needs an upper estimate: at least the bundle's size, and near it (the settings
    of the conftest fixture, and the committed FP32 bundle's command)."""
    from conformance.gen.gen import GenSettings
    from conformance.gen.size import estimate_bundle_bytes
    small = GenSettings(quant="fp32", num_prompts=2, max_new_tokens=8, distill_steps=0, seed=0)
    committed = GenSettings(quant="fp32", num_prompts=4, max_new_tokens=64)
    for s, path in ((small, small_bundle), (committed, os.path.join(ROOT, "bundles", "model_tiny.kdtr"))):
        size, est = os.path.getsize(path), estimate_bundle_bytes(s)
        print(f"{os.path.basename(path)}: {size} bytes, estimated {est} ({est / size:.2f}x)")
        assert size <= est <= 1.25 * size


def test_a_disk_too_small_is_refused_before_the_work(tmp_path):
    """A 1 MiB tmpfs for a ~20 MiB bundle: exit 2 at once, naming the sizes; nothing written, no stage run."""
    import subprocess
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        import pytest
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        out = d / "b.kdtr"
        r = CliRunner().invoke(main, ["gen", "--distill-steps", "0", "--out", str(out)])
        assert r.exit_code == 2, r.output
        assert f"{out}: about" in r.output and "MiB needed, 1.0 MiB free on its file system" in r.output, r.output
        assert "goldens" not in r.output and os.listdir(d) == []
    finally:
        subprocess.run(["umount", str(d)], check=True)
