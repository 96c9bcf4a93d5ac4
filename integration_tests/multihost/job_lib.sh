# The main job across emulated hosts under another launcher (sourced after ../lib.sh and
# hosts.sh): the one-host reference run, a wrapper that records where each rank ran, and the
# comparisons the multi-host launcher tests make.
#
#   reference NAME [FLAGS...]      the job (JOB, then FLAGS) at 4 ranks on host0 alone (fs_launch),
#                                  output in $WORK/NAME.log, metrics in $WORK/NAME/
#   $REPORT PROGRAM ARGS...        runs PROGRAM after printing "placed: rank <r> on <hostname>"
#   expect_placement NAME LOG...   ranks 0, 1 ran on host0 and 2, 3 on host1 (from the lines above)
#   close_losses GOT WANT          STEPS losses each, equal within 1e-5; prints the max difference
#   expect_crossed NAME BEFORE     host1 sent at least 100 kB on its link since mh_tx_bytes 1 was
#                                  BEFORE (the collectives crossed hosts); sets CROSSED (bytes)
#   show_logs LOG...               the logs' tails, for a failure

STEPS=8
JOB=(--steps=$STEPS --checkpoint_dir=none --precision=fp32 --strategy=full_shard)

# The rank's own view of where it runs: the UTS hostname mh_run gave the host (host<i>), and the
# rank from whichever launcher started it (torchrun: RANK; mpirun: OMPI_COMM_WORLD_RANK).
REPORT="$WORK/report.sh"
cat >"$REPORT" <<'SH'
#!/bin/sh
echo "placed: rank ${RANK:-${OMPI_COMM_WORLD_RANK:-?}} on $(hostname)" >&2
exec "$@"
SH
chmod +x "$REPORT"

show_logs() {
  local f
  for f in "$@"; do echo "===== $f (last 60 lines)" >&2; tail -60 "$f" >&2 || true; done
}

reference() {
  local name=$1 status=0; shift
  mh_run 0 timeout -k 5 240 "$FS_LAUNCH" --nnodes=1 --nproc_per_node=4 --master_port=0 \
      --stop_timeout_s=5 -- "$TRAIN_GPT" "${TINY[@]}" "${JOB[@]}" --out_dir="$WORK/$name" "$@" \
      >"$WORK/$name.log" 2>&1 || status=$?
  [[ $status -eq 0 ]] || { show_logs "$WORK/$name.log"; fail "$name (4 ranks on host0) exited with $status"; }
}

# expect_placement NAME LOG...: exactly one "placed:" line per rank 0..3 across the logs, ranks
# 0 and 1 on host0, 2 and 3 on host1.
expect_placement() {
  local name=$1; shift
  local got want
  got=$(cat "$@" | sed -n 's/.*placed: rank \([0-9?]*\) on \([^ ]*\).*/\1 \2/p' | sort -n)
  want=$(printf '0 host0\n1 host0\n2 host1\n3 host1')
  [[ $got == "$want" ]] ||
    { show_logs "$@"; fail "$name: ranks ran on (rank host): $(echo $got), want: $(echo $want)"; }
}

expect_crossed() {
  CROSSED=$(( $(mh_tx_bytes 1) - $2 ))
  (( CROSSED >= 100000 )) || fail "$1: host1 sent only $CROSSED bytes on its link during the job"
}

close_losses() {
  python3 - "$WORK/$1/metrics.jsonl" "$WORK/$2/metrics.jsonl" "$STEPS" "$1" "$2" <<'PY'
import json, sys
def losses(path):
    return {r["step"]: float(r["loss"]) for r in map(json.loads, open(path))
            if r.get("type") == "train"}
got, want, steps = losses(sys.argv[1]), losses(sys.argv[2]), int(sys.argv[3])
if sorted(got) != list(range(1, steps + 1)) or sorted(want) != sorted(got):
    sys.exit(f"FAIL: {sys.argv[4]}: steps {sorted(got)}, {sys.argv[5]}: steps {sorted(want)}")
diff = max(abs(got[s] - want[s]) for s in got)
if diff > 1e-5:
    for s in sorted(got):
        print(f"  step {s}: {got[s]:.8f} vs {want[s]:.8f}", file=sys.stderr)
    sys.exit(f"FAIL: {sys.argv[4]}: losses differ from {sys.argv[5]}'s by up to {diff:.3g}")
print(f"{diff:.3g}")
PY
}
