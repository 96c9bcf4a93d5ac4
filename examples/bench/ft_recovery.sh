#!/bin/bash
# Recovery time of the main job after a SIGKILLed rank (issue 25 item 6): --fault_tolerant
# (the other replica group keeps training, the dead one is restarted alone and rejoins) against
# plain hybrid_shard with checkpoints (every rank restarts and resumes from the last checkpoint).
# Runs are interleaved (ft, plain, ft, plain, ...); prints a table of medians (and min-max).
#
#   ./bazelw build //examples:train_gpt
#   examples/bench/ft_recovery.sh [RUNS=3] [extra train_gpt flags...]
#
# Env: FS_BENCH_STEPS (default 40), FS_BENCH_KILL (the step after which rank 3, in group 1, is
# killed; default 15), FS_BENCH_CKPT (plain mode's --checkpoint_every; default 10),
# TRAIN_GPT (default bazel-bin/examples/train_gpt), FS_BENCH_DIR (default a temp directory),
# FS_BENCH_REPORT_ONLY=1 (no runs: the table of the runs already in FS_BENCH_DIR).
# The model is the main job's default size (width 128, 4 blocks, batch 16, seq 64), bf16, on 4
# ranks = 2 groups x 2 of this machine.
set -euo pipefail
RUNS=${1:-3}
shift || true
TRAIN_GPT=${TRAIN_GPT:-bazel-bin/examples/train_gpt}
STEPS=${FS_BENCH_STEPS:-40}
KILL=${FS_BENCH_KILL:-15}
CKPT=${FS_BENCH_CKPT:-10}
DIR=${FS_BENCH_DIR:-$(mktemp -d)}
mkdir -p "$DIR"
(( KILL % CKPT != 1 )) || { echo "FS_BENCH_KILL % FS_BENCH_CKPT must not be 1 (see below)"; exit 2; }
COMMON=(--nproc_per_node=4 --strategy=hybrid_shard --hybrid_shard_group_size=2 --steps="$STEPS"
        --sample_tokens=0 --eval_every=0 --log_every=1 --fault_kill=3:"$KILL" "$@")
echo "ft_recovery: $RUNS runs each, interleaved; steps $STEPS, rank 3 (group 1) killed after step $KILL;" \
     "plain: --checkpoint_every=$CKPT --max_restarts=1; outputs in $DIR"
if [[ "${FS_BENCH_REPORT_ONLY:-0}" != 1 ]]; then
echo "load before: $(uptime)"
for i in $(seq 1 "$RUNS"); do
  rm -rf "$DIR/ft$i" "$DIR/plain$i"
  "$TRAIN_GPT" "${COMMON[@]}" --fault_tolerant --max_restarts=1 --out_dir="$DIR/ft$i" \
      >"$DIR/ft$i.log" 2>&1 || { tail -20 "$DIR/ft$i.log"; echo "ft run $i failed"; exit 1; }
  "$TRAIN_GPT" "${COMMON[@]}" --checkpoint_every="$CKPT" --max_restarts=1 \
      --out_dir="$DIR/plain$i" >"$DIR/plain$i.log" 2>&1 ||
      { tail -20 "$DIR/plain$i.log"; echo "plain run $i failed"; exit 1; }
  echo "run $i done ($(uptime | sed 's/.*load/load/'))"
done
echo "load after: $(uptime)"
fi
python3 - "$DIR" "$RUNS" "$KILL" <<'PY'
import json, re, statistics, sys
d, runs, kill = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def kill_t(log):
    m = re.search(r"fault injection: SIGKILL after step (\d+) at t=([0-9.]+)", open(log).read())
    return float(m.group(2))
def records(path):
    return [json.loads(l) for l in open(path) if l.strip()]
rows = {k: [] for k in ["ft_next", "ft_detect", "ft_startup", "ft_quorum", "ft_transfer",
                        "ft_catchup", "ft_step", "plain_next", "plain_back", "plain_lost",
                        "plain_step"]}
for i in range(1, runs + 1):
    t = kill_t(f"{d}/ft{i}.log")
    r = records(f"{d}/ft{i}/metrics.jsonl")
    train = [x for x in r if x["type"] == "train"]
    # The writer may record the kill's own step just after the kill: the next step is kill + 1.
    nxt = min(x["t"] for x in train if x["step"] > kill)
    rows["ft_next"].append(nxt - t)
    drop = [x for x in r if x["type"] == "membership" and x["dropped"]]
    rows["ft_detect"].append(drop[0]["quorum_wait_s"])
    joins = [x for x in r if x["type"] == "join"]
    if joins:  # none when the survivors finished before the restarted group was back
        rows["ft_startup"].append(joins[0]["startup_s"])
        rows["ft_quorum"].append(joins[0]["quorum_wait_s"])
        rows["ft_transfer"].append(joins[0]["transfer_s"])
        rows["ft_catchup"].append(joins[0]["first_commit_s"])
    rows["ft_step"].append(statistics.median(x["step_s"] for x in train if x["step"] < kill))
    t = kill_t(f"{d}/plain{i}.log")
    r = records(f"{d}/plain{i}/metrics.jsonl")
    train = [x for x in r if x["type"] == "train"]
    # The resumed run's steps (from the checkpoint's + 1 < kill; the dying run may still record
    # the kill's step just after the kill, hence KILL % CKPT != 1).
    after = [x for x in train if x["t"] > t and (x["step"] < kill or x["step"] > kill)]
    first = min(after, key=lambda x: x["t"])
    rows["plain_next"].append(first["t"] - t)
    rows["plain_back"].append(min(x["t"] for x in after if x["step"] == kill + 1) - t)
    rows["plain_lost"].append(kill - (first["step"] - 1))
    rows["plain_step"].append(statistics.median(x["step_s"] for x in train if x["step"] < kill))
def cell(k, fmt="%.2f"):
    v = rows[k]
    if not v:
        return "n/a (no rejoin before the end)"
    return f"{fmt % statistics.median(v)} ({fmt % min(v)}-{fmt % max(v)})"
print()
print(f"| after the kill of rank 3 (group 1) at step {kill}, median (min-max) of {runs} | --fault_tolerant | plain hybrid_shard + checkpoints |")
print("|---|---|---|")
print(f"| step time before the kill (s) | {cell('ft_step', '%.3f')} | {cell('plain_step', '%.3f')} |")
print(f"| kill -> next completed step (s) | {cell('ft_next')} (survivors, step {kill + 1}) | {cell('plain_next')} (all ranks restarted, resumed) |")
print(f"| kill -> back at step {kill + 1} (s) | = the line above | {cell('plain_back')} |")
print(f"| steps lost (redone) | 0 | {cell('plain_lost', '%d')} |")
print(f"| survivors' quorum wait dropping group 1 (s) | {cell('ft_detect')} | - |")
print(f"| rejoin ({len(rows['ft_startup'])} of {runs} runs): process start -> first quorum (s) | {cell('ft_startup')} | - |")
print(f"| rejoin: quorum wait (s) | {cell('ft_quorum')} | - |")
print(f"| rejoin: state transfer (s) | {cell('ft_transfer', '%.3f')} | - |")
print(f"| rejoin: process start -> first committed step (s) | {cell('ft_catchup')} | - |")
PY
