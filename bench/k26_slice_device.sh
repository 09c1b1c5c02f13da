#!/usr/bin/env bash
# The real-shape K2.6 slice on the GPU machine (docs/golden-bundles.md, "The real-shape slice"). From the
# repository root, on a machine with an NVIDIA GPU:
#
#     KDTR_COMMIT=$(git rev-parse HEAD) bash bench/k26_slice_device.sh OUTDIR [gen|verify|all|quick]
#
# The bundle (~3.4 GB) is never committed or copied: it is made here by the `kdtr gen --preset k26-slice`
# command recorded in bundles/MANIFEST.md, run from WORKDIR (env KDTR_SLICE_WORKDIR, default build/k26_slice,
# git-ignored: outside bundles/, so cuda_engine/device_run.sh's bundles/*.kdtr never picks it up, and the
# command's relative `--out bundles/k26_slice.kdtr` is written as recorded), unless it exists there already
# (a previous phase; delete it to regenerate). The phases (`gen` took 5.6 and 7.4 minutes on the H200's host at
# stops 39-40, its prompts' goldens in forked workers; see docs/golden-bundles.md for what a 10-minute command holds):
# - gen: the bundle, its time and peak memory (OUTDIR/gen.time), its sha256 against the MANIFEST's
#   (OUTDIR/sha256.txt; the metadata records the Python and NumPy versions, so a mismatch is reported, not
#   failed), and every tensor's sha256 (OUTDIR/tensors.json) against bundles/k26_slice.tensors.json (the
#   bundle the MANIFEST records; a tensor that differs fails this phase);
# - verify: `kdtr verify --engine cuda --w4a16 fast --json OUTDIR/k26_slice.cuda.json --save-dump
#   OUTDIR/k26_slice.cuda.kdtr` (the INT4 experts on the tensor-core W4A16 kernel), then `--w4a16 plain`
#   (OUTDIR/k26_slice.cuda_plain.json);
# - all (the default): both;
# - quick: gen, then the `--w4a16 fast` verify only (what fits one 10-minute device command best).
# Everything goes to OUTDIR/log; the exit status is 1 when any step failed.
set -u
OUT_DIR=${1:?usage: bash bench/k26_slice_device.sh OUTDIR [gen|verify|all|quick]}
PHASE=${2:-all}
case "$PHASE" in gen|verify|all|quick) ;; *) echo "phase '$PHASE': choose gen, verify, all or quick"; exit 2 ;; esac
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
exec > >(tee -a "$OUT_DIR/log") 2>&1
export PYTHONUNBUFFERED=1
if [ -d .device-wheels ]; then       # PyCUDA wheels carried to a GPU machine without network
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .device-wheels/*.whl 2>/dev/null
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
kdtr() { python3 -c 'from cli.main import main; main()' "$@"; }
failed=0
step() { echo "== $*"; local t=$SECONDS; "$@"; local rc=$?; echo "== rc=$rc in $((SECONDS - t)) s"; [ $rc -eq 0 ] || failed=1; }

REPO_DIR=$PWD
WORK=${KDTR_SLICE_WORKDIR:-build/k26_slice}
mkdir -p "$WORK/bundles"
WORK=$(cd "$WORK" && pwd)
BUNDLE=bundles/k26_slice.kdtr          # as the MANIFEST command writes it, relative to WORK
# The MANIFEST line is `nice -n 10 kdtr gen --preset k26-slice ... --out bundles/k26_slice.kdtr`
GEN=$(grep -m1 -e '--preset k26-slice' bundles/MANIFEST.md | sed -e 's/^ *//' -e 's/^nice -n [0-9]* //')
WANT=$(sed -n '/k26_slice.kdtr/,$p' bundles/MANIFEST.md | grep -m1 -o 'sha256: `[0-9a-f]*`' | tr -d '`' | cut -d' ' -f2)
case "$GEN" in
    "kdtr gen "*"--out $BUNDLE"*) ;;
    *) echo "bundles/MANIFEST.md has no 'kdtr gen --preset k26-slice ... --out $BUNDLE' line: got '$GEN'"; exit 2 ;;
esac

nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
echo "phase $PHASE; commit ${KDTR_COMMIT:-unknown}; $(nproc) CPUs; $(free -g | awk '/Mem:/ {print $2}') GB RAM"
cd "$WORK"
if [ "$PHASE" != verify ] && [ ! -f "$BUNDLE" ]; then
    echo "== generating $BUNDLE (the MANIFEST command): $GEN"
    t=$SECONDS
    TIMER=""; [ -x /usr/bin/time ] && TIMER="/usr/bin/time -v -o $OUT_DIR/gen.time"
    $TIMER python3 -c 'from cli.main import main; main()' ${GEN#kdtr } || failed=1
    echo "== gen took $((SECONDS - t)) s"
fi
[ -f "$BUNDLE" ] || { echo "no $WORK/$BUNDLE: the gen failed, or run the gen phase first"; exit 1; }
if [ "$PHASE" != verify ]; then
    GOT=$(sha256sum "$BUNDLE" | cut -d' ' -f1)
    printf 'manifest %s\nhere     %s\n' "$WANT" "$GOT" | tee "$OUT_DIR/sha256.txt"
    if [ -z "$WANT" ]; then echo "sha256: the MANIFEST records none yet"
    elif [ "$GOT" = "$WANT" ]; then echo "sha256: matches the MANIFEST"
    else echo "sha256: differs from the MANIFEST (other Python/NumPy/CPU: compare OUTDIR/tensors.json)"; fi
    python3 -c 'import json, sys; from kdtr_format.describe import describe
d = describe(sys.argv[1]); mine = {t["name"]: t["sha256"] for t in d["tensors"]}
json.dump({"metadata": d["metadata"], "tensors": mine}, open(sys.argv[2], "w"), indent=0)
want = json.load(open(sys.argv[3]))
same = sum(mine.get(n) == h for n, h in want.items())
print(f"tensors: {same} of {len(want)} have the sha256 recorded in bundles/k26_slice.tensors.json"
      + ("" if same == len(want) == len(mine) else f"; {len(mine)} in this bundle: DIFFERENT"))
sys.exit(0 if same == len(want) == len(mine) else 1)' "$BUNDLE" "$OUT_DIR/tensors.json" "$REPO_DIR/bundles/k26_slice.tensors.json" || failed=1
fi
[ "$PHASE" = gen ] && { echo "k26_slice_device gen: $([ $failed -eq 0 ] && echo PASSED || echo FAILED)"; exit $failed; }

step kdtr verify "$BUNDLE" --engine cuda --w4a16 fast --json "$OUT_DIR/k26_slice.cuda.json" \
    --save-dump "$OUT_DIR/k26_slice.cuda.kdtr"
[ "$PHASE" = quick ] || step kdtr verify "$BUNDLE" --engine cuda --w4a16 plain --json "$OUT_DIR/k26_slice.cuda_plain.json"
ls -l "$OUT_DIR"
echo "k26_slice_device $PHASE: $([ $failed -eq 0 ] && echo ALL STEPS PASSED || echo SOME STEP FAILED)"
exit $failed
