#!/bin/bash
# The job's TCPStore rejects a client without the job's token: with fs_launch hosting the store
# of a running job, a train_gpt rank pointed at it with a wrong token, and one with none, fail
# within seconds with an error that names the token; SIGTERM then stops the job.
source "$(dirname "$0")/lib.sh" "$@"

for attempt in 1 2 3 4 5; do
  port=$(( 20000 + RANDOM % 30000 ))
  FS_STORE_TOKEN=right-token timeout -k 5 120 "$FS_LAUNCH" --nproc_per_node=1 \
      --master_port="$port" -- /bin/sleep 100 >"$WORK/launcher.log" 2>&1 &
  launcher=$!
  for _ in $(seq 50); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
    kill -0 "$launcher" 2>/dev/null || break
    sleep 0.2
  done
  kill -0 "$launcher" 2>/dev/null && break
  wait "$launcher" || true  # the port was taken: try another
done
kill -0 "$launcher" 2>/dev/null || { cat "$WORK/launcher.log"; fail "fs_launch did not start"; }

for token in wrong-token ""; do
  start=$(date +%s)
  status=0
  env -u FS_STORE_TOKEN RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
      TORCHELASTIC_USE_AGENT_STORE=True FS_STORE_PROTOCOL=fairscale ${token:+FS_STORE_TOKEN=$token} \
      timeout -k 5 60 "$TRAIN_GPT" "${TINY[@]}" --steps=5 --out_dir="$WORK/intruder" \
      >"$WORK/intruder.log" 2>&1 || status=$?
  took=$(( $(date +%s) - start ))
  [[ $status -ne 0 && $status -ne 124 ]] || { cat "$WORK/intruder.log"; fail "token '$token': status $status"; }
  grep -q "wrong or missing job token" "$WORK/intruder.log" ||
    { cat "$WORK/intruder.log"; fail "token '$token': no token error"; }
  (( took < 30 )) || fail "token '$token': took ${took}s to fail"
  pass "token '${token:-<none>}' rejected in ${took}s: $(grep -m1 'token' "$WORK/intruder.log")"
done

kill -TERM "$launcher"
status=0
wait "$launcher" || status=$?
[[ $status -eq 143 ]] || { cat "$WORK/launcher.log"; fail "fs_launch after SIGTERM: $status"; }
pass "SIGTERM stopped the job (status 143)"
