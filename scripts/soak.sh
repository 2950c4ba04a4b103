#!/usr/bin/env bash
# Long, random-seed runs of the model-checked tests (tests/multi_client.rs, tests/fsx_model.rs,
# tests/concurrent_writers.rs). Each run prints its seed (MODEL_SEED=…, FSX_SEED=…, CONC_SEED=…);
# a failure names the seed to rerun with.
#
#   scripts/soak.sh                 # both: ROUNDS random-seed model runs, one long fsx run
#   scripts/soak.sh model           # only the multi-client model test
#   scripts/soak.sh fsx             # only fsx
#   scripts/soak.sh conc            # only concurrent writers on one file (2 and 3 mounts)
#   scripts/soak.sh field           # only the field scenario (chmod/touch/setxattr/rename
#                                   # right after another node's rewrite)
#
# Knobs (environment):
#   ROUNDS=5            model runs, each with its own random seed
#   MODEL_OPS=3000      operations per model run
#   MODEL_MOUNTS=2      2 or 3 mounts of ours
#   MODEL_SEED=…        fixed seed instead of a random one (then ROUNDS=1 makes sense)
#   FSX_OPS=100000      fsx operations
#   FSX_SEED=random     or a number
#   FSX_ROUNDS=1        fsx runs
#   FIELD_REPS=200      repetitions per variant of the field scenario
#   CONC_ROUNDS=16      rounds per concurrent-writers run (two runs: 2 and 3 mounts)
#   CONC_OPS=300        operations per node and round
#   KEEP_GOING=1        do not stop at the first failing run
# Logs go to target/soak/. Exit status: 0 if every run passed.
# The tests spawn <target dir>/debug/seaweedfs-csi-driver: with a CARGO_TARGET_DIR shared by
# several worktrees that binary is whichever worktree built last. Give a soak its own
# CARGO_TARGET_DIR (a `cp -al` of a built one, minus its .cargo-lock, is quick).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
out=target/soak
mkdir -p "$out"
export RUST_TEST_THREADS=1
: "${ROUNDS:=5}" "${MODEL_OPS:=3000}" "${FSX_OPS:=100000}" "${FSX_ROUNDS:=1}"
: "${FIELD_REPS:=200}" "${KEEP_GOING:=0}" "${CONC_ROUNDS:=16}" "${CONC_OPS:=300}"
export MODEL_OPS FSX_OPS FIELD_REPS CONC_ROUNDS CONC_OPS
failed=0

cargo test --features test-support --no-run --test multi_client --test fsx_model --test concurrent_writers >"$out/build.log" 2>&1 || {
    tail -30 "$out/build.log"
    exit 1
}

run() { # name, cargo test args...
    local name=$1
    shift
    local log="$out/$name-$(date +%Y%m%d-%H%M%S).log"
    local t0=$SECONDS
    if cargo test --features test-support "$@" -- --nocapture >"$log" 2>&1; then
        echo "PASS $name ($((SECONDS - t0)) s) $(grep -hoE '(MODEL|FSX|CONC)_SEED=[0-9]+' "$log" | head -1) log: $log"
    else
        failed=$((failed + 1))
        echo "FAIL $name ($((SECONDS - t0)) s) $(grep -hoE '(MODEL|FSX|CONC)_SEED=[0-9]+' "$log" | head -1) log: $log"
        grep -hE 'MODEL MISMATCH|FSX FAILURE|CONCURRENT FAILURE|repetitions lost' -A12 "$log" | head -40
        [ "$KEEP_GOING" = 1 ] || exit 1
    fi
}

if [ "$what" = all ] || [ "$what" = model ]; then
    for i in $(seq 1 "$ROUNDS"); do
        MODEL_SEED=${MODEL_SEED:-random} run "model-$i" --test multi_client random_operations
    done
fi
if [ "$what" = all ] || [ "$what" = field ]; then
    MODEL_SEED=${MODEL_SEED:-random} run field --test multi_client field_
fi
if [ "$what" = all ] || [ "$what" = conc ]; then
    for n in 2 3; do
        CONC_MOUNTS=$n CONC_SEED=${CONC_SEED:-random} run "conc-$n" --test concurrent_writers
    done
fi
if [ "$what" = all ] || [ "$what" = fsx ]; then
    for i in $(seq 1 "$FSX_ROUNDS"); do
        FSX_SEED=${FSX_SEED:-random} run "fsx-$i" --test fsx_model
    done
fi
[ "$failed" = 0 ] || {
    echo "$failed run(s) failed"
    exit 1
}
echo "all runs passed"
