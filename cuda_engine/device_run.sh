#!/usr/bin/env bash
# The GPU run that proves the CUDA engine (docs/cuda-engine.md). On a machine with an NVIDIA GPU, from the
# repository root:
#
#     KDTR_COMMIT=$(git rev-parse HEAD) bash cuda_engine/device_run.sh OUTDIR
#
# 1. `kdtr verify BUNDLE --engine cuda --save-dump OUTDIR/<bundle>.cuda.kdtr` for every committed bundle (with
#    the engine's live DDTree checks), and for an INT4 bundle once per --w4a16 mode (fast -> <bundle>.cuda.kdtr,
#    plain -> <bundle>.cuda-plain.kdtr):
#    these are the proofs to commit as bundles/proofs/ (metadata: device, driver, commit, source hash, mode);
# 2. determinism: a second run's dump is byte-identical to the first;
# 3. the GPU tests (every kernel vs its NumPy oracle, the fast W4A16 kernel vs the plain one, the engine end to
#    end, determinism, graph == no graph, the engine's own DDTree: drafter, device tree builder, node context,
#    determinism; the cost-aware budget; bf16 dense weights); OUTDIR/w4a16_errors.jsonl: both kernels' errors per test case; (after the proofs, so a run
#    cut short by its time limit still returns them);
# 4. (last, the slowest) compute-sanitizer memcheck over an end-to-end INT4 verify, racecheck over the
#    shared-memory kernels;
# 5. `kdtr bench engine` (decode latency, with and without the CUDA graph, vs the launch floor; an INT4 bundle
#    in both --w4a16 modes), `kdtr bench w4a16` (the W4A16 kernels vs floor, cuBLAS, tinygemm; MoE layer) and
#    `kdtr bench ddtree` (DDTree vs AR tokens/s on both bundles, one run);
# 6. `kdtr verify --engine auto` picks cuda; racecheck over the 1..16-token W4A16 entries' own GPU tests.
# Everything goes to OUTDIR/log; the exit status is 1 when any step failed. KDTR_DEVICE_RUN_CORE=1 stops after
# steps 1-3 (the proofs, determinism, the GPU tests): a re-proof after a change outside the kernels' code,
# when the sanitizers and benches of the previous full run still describe the same kernel code.
set -u
OUT_DIR=${1:?usage: bash cuda_engine/device_run.sh OUTDIR}
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

nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
echo "commit ${KDTR_COMMIT:-unknown}"
# the proofs: python3 -m cuda_engine.proofs BUNDLE lists "MODE PROOF_NAME" per --w4a16 mode ("- NAME": none)
COMMITTED=$(ls bundles/*.kdtr | grep -v '/k26_slice.kdtr$')    # the real-shape slice: bench/k26_slice_device.sh
for b in $COMMITTED; do
    while read -r mode name; do
        step kdtr verify "$b" --engine cuda $([ "$mode" = - ] || echo --w4a16 "$mode") --save-dump "$OUT_DIR/$name"
    done < <(python3 -m cuda_engine.proofs "$b")
done
step kdtr verify bundles/model_tiny.kdtr --engine cuda --save-dump /tmp/second_run.kdtr
step cmp "$OUT_DIR/model_tiny.cuda.kdtr" /tmp/second_run.kdtr
# the GPU tests (after the proofs, so that a run cut short by its time limit still returns them)
KDTR_W4A16_ERRORS="$OUT_DIR/w4a16_errors.jsonl" step python3 -m pytest -q -p no:cacheprovider -m cuda \
    tests/test_cuda_kernels.py tests/test_cuda_w4a16.py tests/test_cuda_w4a16_grouped.py tests/test_cuda_engine.py \
    tests/test_cuda_ddtree.py tests/test_cuda_held_routing.py tests/test_cuda_cost_aware.py tests/test_cuda_bf16_weights.py
if [ "${KDTR_DEVICE_RUN_CORE:-0}" = 1 ]; then
    echo "device_run (core steps only): $([ $failed -eq 0 ] && echo ALL STEPS PASSED || echo SOME STEP FAILED)"
    exit $failed
fi
for b in $COMMITTED; do
    step kdtr bench engine "$b" --json "$OUT_DIR/bench.$(basename "$b" .kdtr).json"
done
step kdtr bench engine bundles/model_int4_tiny.kdtr --w4a16 plain --json "$OUT_DIR/bench.model_int4_tiny.plain.json"
step kdtr bench w4a16 --json "$OUT_DIR/bench.w4a16.json"
step kdtr bench ddtree $COMMITTED --json "$OUT_DIR/bench.ddtree.json"
# memcheck: every kernel of a whole verify run (INT4: the fast W4A16 path and the live DDTree included).
# --report-api-errors no: cuda-bindings probes driver entry points with cuGetProcAddress, whose "not found"
# answers memcheck would count as errors; the engine checks every driver result itself. racecheck
# (hazards on shared memory only, ~50x slower), one kernel family at a time: the fast W4A16 kernels (the
# activation terms staged in shared memory; their split-K tickets and partials are global memory, which
# racecheck does not see: the bit-identity tests over repeated and graph-replayed runs cover those), the
# DDTree builder (top-K sort and heap in shared memory) and the grouped MoE path's work list
# (its scans and placement in shared memory). Last: the slowest steps.
step timeout 240 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    python3 -c 'from cli.main import main; main()' verify bundles/model_int4_tiny.kdtr --engine cuda
for k in w4a16_mma ddtree_ moe_group; do
    step timeout 150 compute-sanitizer --tool racecheck --kernel-name kns=$k --error-exitcode 9 \
        python3 -c 'from cli.main import main; main()' verify bundles/model_int4_tiny.kdtr --engine cuda
done
step kdtr verify bundles/model_tiny.kdtr --engine auto
# racecheck over the attention kernels' own GPU tests (9 shapes, K2.6's included): over a whole verify their GEMM
# tiles' shared-memory traffic keeps racecheck past 150 s
step timeout 150 compute-sanitizer --tool racecheck --kernel-name kns=mla_ --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_kernels.py -k mla_attention
# racecheck over the tensor-core linear's tests (its 8 warps' sums meet in shared memory), every launch shape
step timeout 150 compute-sanitizer --tool racecheck --kernel-name kns=linear_mma --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_kernels.py -k linear_mma
# racecheck over the entries of 1..16 tokens with 1, 2, 4 and 8 row blocks per block through their GPU tests,
# every launch shape they have (the INT4 verify above runs only those its own shapes pick)
step timeout 240 compute-sanitizer --tool racecheck --kernel-name kns=w4a16_mma --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda_w4a16.py -k every_row_count
echo "device_run: $([ $failed -eq 0 ] && echo ALL STEPS PASSED || echo SOME STEP FAILED)"
exit $failed
