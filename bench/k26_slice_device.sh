#!/usr/bin/env bash
# The real-shape K2.6 slice on the GPU machine (docs/golden-bundles.md, "The real-shape slice"). From the
# repository root, on a machine with an NVIDIA GPU:
#
#     KDTR_COMMIT=$(git rev-parse HEAD) bash bench/k26_slice_device.sh OUTDIR
#
# The bundle (~3.4 GB) is never committed or copied: it is made here, by the `kdtr gen --preset k26-slice`
# command recorded in bundles/MANIFEST.md, unless bundles/k26_slice.kdtr already exists (a previous run;
# delete it to regenerate). Then:
# 1. its sha256 against the MANIFEST's (written to OUTDIR/sha256.txt; float64 BLAS may round the goldens'
#    last bits differently on another CPU, docs/golden-bundles.md: a mismatch is reported, the verify still
#    runs, and the bundle's own tolerances still apply);
# 2. `kdtr verify bundles/k26_slice.kdtr --engine cuda --w4a16 fast --json OUTDIR/k26_slice.cuda.json
#    --save-dump OUTDIR/k26_slice.cuda.kdtr` (the INT4 experts on the tensor-core W4A16 kernel);
# 3. the same verify with `--w4a16 plain` (the packed weights as stored), JSON report only.
# Everything goes to OUTDIR/log; the exit status is 1 when any step failed (a sha256 mismatch included).
set -u
OUT_DIR=${1:?usage: bash bench/k26_slice_device.sh OUTDIR}
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/log") 2>&1
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

BUNDLE=bundles/k26_slice.kdtr
# The MANIFEST line is `nice -n 10 kdtr gen --preset k26-slice ... --out bundles/k26_slice.kdtr`
GEN=$(grep -m1 -e '--preset k26-slice' bundles/MANIFEST.md | sed -e 's/^ *//' -e 's/^nice -n [0-9]* //')
WANT=$(sed -n '/k26_slice.kdtr/,$p' bundles/MANIFEST.md | grep -m1 -o 'sha256: `[0-9a-f]*`' | tr -d '`' | cut -d' ' -f2)
case "$GEN" in
    "kdtr gen "*"--out $BUNDLE"*) ;;
    *) echo "bundles/MANIFEST.md has no 'kdtr gen --preset k26-slice ... --out $BUNDLE' line: got '$GEN'"; exit 2 ;;
esac

nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
echo "commit ${KDTR_COMMIT:-unknown}; $(nproc) CPUs; $(free -g | awk '/Mem:/ {print $2}') GB RAM"
if [ ! -f "$BUNDLE" ]; then
    echo "== generating $BUNDLE (the MANIFEST command): $GEN"
    t=$SECONDS
    TIMER=""; [ -x /usr/bin/time ] && TIMER="/usr/bin/time -v -o $OUT_DIR/gen.time"
    $TIMER python3 -c 'from cli.main import main; main()' ${GEN#kdtr } || failed=1
    echo "== gen took $((SECONDS - t)) s"
fi
[ -f "$BUNDLE" ] || { echo "no $BUNDLE: the gen failed"; exit 1; }
GOT=$(sha256sum "$BUNDLE" | cut -d' ' -f1)
printf 'manifest %s\nhere     %s\n' "$WANT" "$GOT" | tee "$OUT_DIR/sha256.txt"
if [ -z "$WANT" ]; then echo "sha256: the MANIFEST records none yet (record this one if the verify passes)"; failed=1
elif [ "$GOT" = "$WANT" ]; then echo "sha256: matches the MANIFEST"; else echo "sha256: DIFFERS from the MANIFEST"; failed=1; fi

step kdtr verify "$BUNDLE" --engine cuda --w4a16 fast --json "$OUT_DIR/k26_slice.cuda.json" \
    --save-dump "$OUT_DIR/k26_slice.cuda.kdtr"
step kdtr verify "$BUNDLE" --engine cuda --w4a16 plain --json "$OUT_DIR/k26_slice.cuda_plain.json"
ls -l "$OUT_DIR"
# cuda_engine/device_run.sh verifies every bundles/*.kdtr: delete this one before running it on the same machine
echo "note: $BUNDLE stays for a rerun; remove it before cuda_engine/device_run.sh (its bundles/*.kdtr glob)"
echo "k26_slice_device: $([ $failed -eq 0 ] && echo ALL STEPS PASSED || echo SOME STEP FAILED)"
exit $failed
