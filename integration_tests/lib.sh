# Shared helpers of the integration tests (sourced). Every test runs the real binaries as
# processes on 127.0.0.1: fs_launch (//launch) starting train_gpt (//examples) ranks over tcp.
# Usage in a test: source lib.sh "$@"   (args: fs_launch path, train_gpt path)
set -euo pipefail

FS_LAUNCH=$(readlink -f "$1")
TRAIN_GPT=$(readlink -f "$2")
WORK=${TEST_TMPDIR:-$(mktemp -d)}/work
rm -rf "$WORK" && mkdir -p "$WORK"
export OMP_NUM_THREADS=1

# A tiny GPT: a few seconds per run on 2 cores.
TINY=(--width=32 --blocks=2 --heads=2 --seq=32 --batch=8 --sample_tokens=0 --eval_every=10
      --eval_batches=1 --log_every=5 --threads=1)

fail() { echo "FAIL: $*" >&2; exit 1; }
pass() { echo "PASS: $*"; }

# launch NAME NPROC [fs_launch flags...] -- [train_gpt flags...]: runs the job under a deadline,
# output in $WORK/NAME.log, metrics in $WORK/NAME/metrics.jsonl; sets STATUS (exit status).
launch() {
  local name=$1 nproc=$2; shift 2
  local lflags=()
  while [[ $# -gt 0 && $1 != -- ]]; do lflags+=("$1"); shift; done
  [[ $# -gt 0 ]] && shift
  STATUS=0
  timeout -k 5 240 "$FS_LAUNCH" --nproc_per_node="$nproc" --master_port=0 --stop_timeout_s=5 \
      "${lflags[@]}" -- "$TRAIN_GPT" "${TINY[@]}" --out_dir="$WORK/$name" "$@" \
      >"$WORK/$name.log" 2>&1 || STATUS=$?
  [[ $STATUS -ne 124 ]] || { cat "$WORK/$name.log"; fail "$name: still running after 240 s"; }
}

# final_field NAME FIELD: a field of the run's final metrics record (jq syntax, compact).
final_field() {
  jq -c "select(.type == \"final\") | .$2" "$WORK/$1/metrics.jsonl" | tail -1
}
# losses NAME: "step loss" per training step, as recorded.
losses() {
  jq -r 'select(.type == "train") | "\(.step) \(.loss)"' "$WORK/$1/metrics.jsonl"
}

# expect_same_losses GOT WANT STEPS: run GOT recorded exactly WANT's losses, step by step (the job
# is deterministic per seed, step and rank), and STEPS of them.
expect_same_losses() {
  local got=$1 want=$2 steps=$3
  [[ -s "$WORK/$got/metrics.jsonl" ]] || { cat "$WORK/$got.log"; fail "$got wrote no metrics"; }
  [[ "$(losses "$got")" == "$(losses "$want")" ]] ||
    { diff <(losses "$want") <(losses "$got") || true; fail "$got: losses differ from $want's"; }
  [[ $(losses "$got" | wc -l) -eq $steps ]] || fail "$got: expected $steps steps"
}

# free_port: a 127.0.0.1 port that was free a moment ago (the OS picked it).
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# expect_resumed NAME STEP FROM TO: the run says it resumed at STEP from FROM ranks (log), its
# resume record says STEP FROM TO, and the full-parameter hash it gathered after loading is the
# one the checkpoint of STEP recorded at its save. Sets SAVED_HASH.
expect_resumed() {
  local name=$1 step=$2 from=$3 to=$4 m="$WORK/$1/metrics.jsonl" resumed record
  grep -q "resumed at step $step (saved at $from ranks)" "$WORK/$name.log" ||
    { cat "$WORK/$name.log"; fail "the $to-rank run did not say it resumed at step $step from $from ranks"; }
  SAVED_HASH=$(jq -r "select(.type == \"checkpoint\" and .step == $step) | .full_param_fnv1a64" "$m")
  resumed=$(jq -r 'select(.type == "resume") | .full_param_fnv1a64' "$m")
  record=$(jq -r 'select(.type == "resume") | "\(.step) \(.from_world_size) \(.world_size)"' "$m")
  [[ "$record" == "$step $from $to" ]] ||
    fail "resume record says step/from/to '$record', want '$step $from $to'"
  [[ -n "$SAVED_HASH" && "$SAVED_HASH" == "$resumed" ]] ||
    fail "full parameters at resume $resumed, saved at step $step $SAVED_HASH"
}
