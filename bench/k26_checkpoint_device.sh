#!/usr/bin/env bash
# Goldens from a checkpoint at K2.6's true dimensions on the GPU machine (docs/golden-bundles.md, "Goldens from
# a checkpoint"). From the repository root, on a machine with an NVIDIA GPU:
#
#     KDTR_COMMIT=$(git rev-parse HEAD) bash bench/k26_checkpoint_device.sh OUTDIR [synth|gen|verify|verify-fast|verify-plain|all]
#
# Everything is written under OUTDIR (give it the machine's large disk). The phases run as separate commands,
# so OUTDIR must outlive one: where the working tree is copied afresh for each command, only paths that a
# tracked .gitignore ignores are kept (cuda_engine/.build/k26ck is one; a folder ignored only through
# .git/info/exclude is removed between commands: seen on the GPU machine, 2026-12-01).
# - synth: OUTDIR/ckpt, a synthetic K2.6-layout checkpoint at K2.6's true dims (hidden 7168, vocab 163840,
#   384 INT4 experts, 4 layers: the dense layer 0 and three MoE layers, 8 shards of <= 5 GiB under an index;
#   bench/synth_checkpoint.py, all cores), about 35 GB; its time in OUTDIR/synth.time;
# - gen: `kdtr gen --from-checkpoint OUTDIR/ckpt --layers 3` (layer 3 is never read) into
#   OUTDIR/k26_ckpt3.kdtr, about 25.5 GB: time and peak memory (OUTDIR/gen.time from /usr/bin/time -v: the
#   largest process; OUTDIR/gen.mem: the machine's used memory sampled every 2 s, forked prompt workers
#   included), the bundle's figures (OUTDIR/gen.figures.json);
# - verify: `kdtr verify --engine cuda --w4a16 fast` and `--w4a16 plain` (OUTDIR/verify.fast.json,
#   OUTDIR/verify.plain.json); verify-fast and verify-plain: one of them (measured at 0626ba4: fast 157 s,
#   plain 129 s, both in one 10-minute command; at d768561 fast did not finish its load within 585 s: the
#   single-threaded repack of 768 experts, since made word-parallel and threaded);
# - all (the default): the three in turn; a phase whose output exists is skipped (delete it to redo).
# Free disk is checked before synth and gen. Everything goes to OUTDIR/log; the exit status is 1 when a step
# failed. Each phase is meant to fit one 10-minute device command (estimates: docs/golden-bundles.md,
# "Goldens from a checkpoint"); run them as separate commands.
set -u
OUT_DIR=${1:?usage: bash bench/k26_checkpoint_device.sh OUTDIR [synth|gen|verify|verify-fast|verify-plain|all]}
PHASE=${2:-all}
case "$PHASE" in synth|gen|verify|verify-fast|verify-plain|all) ;;
    *) echo "phase '$PHASE': choose synth, gen, verify, verify-fast, verify-plain or all"; exit 2 ;; esac
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
SYNTH_ARGS=${KDTR_CKPT_SYNTH_ARGS:-}   # another checkpoint (e.g. "--preset tiny --layers 4": a smoke run anywhere)
need_disk() {   # need_disk GB WHAT: refuse a phase that cannot fit, before it starts (K2.6 dims only)
    [ -n "$SYNTH_ARGS" ] && return 0
    local free_gb; free_gb=$(df -BG --output=avail "$OUT_DIR" | tail -1 | tr -dc 0-9)
    if [ "$free_gb" -lt "$1" ]; then
        echo "$2 needs about $1 GB free under $OUT_DIR, $free_gb GB are: use a larger disk"; exit 1
    fi
}
TIMER=""; [ -x /usr/bin/time ] && TIMER="/usr/bin/time -v -o"
timed() { local out=$1; shift; if [ -n "$TIMER" ]; then $TIMER "$out" "$@"; else "$@"; fi; }

CKPT=$OUT_DIR/ckpt
BUNDLE=$OUT_DIR/k26_ckpt3.kdtr
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv || echo "no nvidia-smi here"
echo "phase $PHASE; commit ${KDTR_COMMIT:-unknown}; $(nproc) CPUs; $(free -g | awk '/Mem:/ {print $2}') GB RAM; $(df -h --output=avail "$OUT_DIR" | tail -1) free"

if [ "$PHASE" = synth ] || [ "$PHASE" = all ]; then
    if [ -f "$CKPT/model.safetensors.index.json" ]; then echo "== $CKPT exists: synth skipped"
    else
        need_disk 38 "the synthetic checkpoint (35 GB)"
        # shellcheck disable=SC2086
        step timed "$OUT_DIR/synth.time" python3 bench/synth_checkpoint.py "$CKPT" ${SYNTH_ARGS:---preset k26 --layers 4} \
            --shard-gb 5 --jobs "$(nproc)"
        du -sh "$CKPT"
    fi
fi

if [ "$PHASE" = gen ] || [ "$PHASE" = all ]; then
    [ -f "$CKPT/model.safetensors.index.json" ] || { echo "no checkpoint in $CKPT: run the synth phase first"; exit 1; }
    if [ -f "$BUNDLE" ]; then echo "== $BUNDLE exists: gen skipped"
    else
        need_disk 28 "the truncated bundle (25.5 GB)"
        ( peak=0; while sleep 2; do used=$(free -b | awk '/Mem:/ {print $3}'); [ "$used" -gt "$peak" ] && peak=$used
          echo "$peak" > "$OUT_DIR/gen.mem"; done ) &
        sampler=$!
        base=$(free -b | awk '/Mem:/ {print $3}')
        # 1 prompt of 1 token and the long-position prompt (6 tokens at 196608), 4 tokens each: every forward
        # upcasts lm_head (1.2 G values) and the routed experts it runs; budget 4: trees of <= 5 rows.
        # KDTR_CKPT_GEN_ARGS replaces these prompt options.
        GEN_ARGS=${KDTR_CKPT_GEN_ARGS:---num-prompts 1 --max-new-tokens 4 --budget 4}
        # shellcheck disable=SC2086
        step timed "$OUT_DIR/gen.time" python3 -c 'from cli.main import main; main()' gen --from-checkpoint "$CKPT" \
            --layers 3 $GEN_ARGS --distill-steps 0 --bf16-profile no --out "$BUNDLE"
        kill "$sampler" 2>/dev/null
        echo "machine memory used: $(( $(cat "$OUT_DIR/gen.mem") / 2**20 )) MiB at peak, $(( base / 2**20 )) MiB before the gen"
        grep -E "Maximum resident|Elapsed" "$OUT_DIR/gen.time" 2>/dev/null
        [ -f "$BUNDLE" ] && python3 -c 'import json, sys; from kdtr_format import open_kdtr
with open_kdtr(sys.argv[1]) as f: m = f.metadata
json.dump({k: m[k] for k in ("figures", "long_position", "drafter_training", "model_config")} |
          {"source": {k: v for k, v in m["source"].items() if k != "tensor_sha256"},
           "hashed_tensors": len(m["source"]["tensor_sha256"])}, open(sys.argv[2], "w"), indent=1)' \
            "$BUNDLE" "$OUT_DIR/gen.figures.json" && ls -l "$BUNDLE"
    fi
fi

for mode in fast plain; do
    case "$PHASE" in verify|all|"verify-$mode") ;; *) continue ;; esac
    [ -f "$BUNDLE" ] || { echo "no $BUNDLE: run the gen phase first"; exit 1; }
    step kdtr verify "$BUNDLE" --engine cuda --w4a16 "$mode" --json "$OUT_DIR/verify.$mode.json"
done
ls -l "$OUT_DIR"
echo "k26_checkpoint_device $PHASE: $([ $failed -eq 0 ] && echo ALL STEPS PASSED || echo SOME STEP FAILED)"
exit $failed
