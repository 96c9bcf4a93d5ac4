#!/bin/bash
# Bad rendezvous input under torchrun's contract, each failing within the timeout with an error
# that names the address (FS_COMM_TIMEOUT_S=3 bounds the rendezvous):
#   * MASTER_ADDR unreachable: a documentation address (198.51.100.7) inside a network namespace
#     with only loopback (unshare -rn, else the test sandbox's own), so nothing leaves: with the
#     address the rank advertises given (FS_SOCKET_IFNAME=lo) the rendezvous fails naming
#     MASTER_ADDR:MASTER_PORT; left to the automatic choice (the route to MASTER_ADDR) the rank
#     fails before it, saying there is no route and to set FS_SOCKET_IFNAME;
#   * a c10d store that accepts and never answers (a fake server here);
#   * an sbatch batch step (SLURM_PROCID=0, SLURM_NTASKS=4, no srun step) refused at once.
# (c10d store not linked: //comm:registry_test's C10dStoreNotLinked.)
source "$(dirname "$0")/lib.sh" "$1" "$2"

# run_rank NAME [VAR=value...]: one train_gpt rank with those variables; sets STATUS and TOOK.
run_rank() {
  local name=$1; shift
  local start=$(date +%s%N)
  STATUS=0
  env FS_COMM_TIMEOUT_S=3 "$@" timeout -k 5 60 "$TRAIN_GPT" "${TINY[@]}" --steps=2 \
      --checkpoint_dir=none --out_dir="$WORK/$name" >"$WORK/$name.log" 2>&1 || STATUS=$?
  TOOK=$(( ($(date +%s%N) - start) / 1000000 ))
  [[ $STATUS -ne 0 && $STATUS -ne 124 ]] || { cat "$WORK/$name.log"; fail "$name: status $STATUS"; }
  (( TOOK < 15000 )) || { cat "$WORK/$name.log"; fail "$name: took ${TOOK} ms"; }
}
expect_log() {
  grep -q -- "$2" "$WORK/$1.log" || { cat "$WORK/$1.log"; fail "$1: no '$2' in the output"; }
}

NETNS=()
# (loopback up in it, so that FS_SOCKET_IFNAME=lo has an address)
if unshare -rn true 2>/dev/null; then
  NETNS=(unshare -rn sh -c '/usr/sbin/ip link set lo up 2>/dev/null || true; exec "$@"' sh)
fi
for proto in c10d fairscale; do
  name="unreachable_$proto"
  run_rank "$name" "${NETNS[@]}" env RANK=1 WORLD_SIZE=2 MASTER_ADDR=198.51.100.7 \
      MASTER_PORT=29500 TORCHELASTIC_USE_AGENT_STORE=True FS_STORE_PROTOCOL="$proto" \
      FS_SOCKET_IFNAME=lo
  expect_log "$name" "198.51.100.7:29500"
  expect_log "$name" "cannot create the communicator"
  pass "$name: failed in ${TOOK} ms: $(grep -m1 -o '\(UNAVAILABLE\|DEADLINE_EXCEEDED\).*' "$WORK/$name.log" | cut -c1-160)"
done
name="unreachable_no_route"
run_rank "$name" "${NETNS[@]}" env RANK=1 WORLD_SIZE=2 MASTER_ADDR=198.51.100.7 MASTER_PORT=29500
expect_log "$name" "cannot choose the address this rank advertises to the others: the route to MASTER_ADDR '198.51.100.7'"
expect_log "$name" "set FS_SOCKET_IFNAME"
pass "$name: failed in ${TOOK} ms: $(grep -m1 -o 'cannot choose.*' "$WORK/$name.log" | cut -c1-160)"

# A server that accepts every connection and never writes a byte.
python3 - "$WORK/silent.port" <<'PY' &
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(16)
open(sys.argv[1] + ".tmp", "w").write(str(s.getsockname()[1]))
__import__("os").rename(sys.argv[1] + ".tmp", sys.argv[1])
conns = []
s.settimeout(60)
end = time.time() + 60
while time.time() < end:
    try:
        conns.append(s.accept()[0])
    except socket.timeout:
        break
PY
silent=$!
trap 'kill $silent 2>/dev/null || true' EXIT
for _ in $(seq 100); do [[ -s "$WORK/silent.port" ]] && break; sleep 0.1; done
port=$(cat "$WORK/silent.port")
run_rank silent RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
    TORCHELASTIC_USE_AGENT_STORE=True
expect_log silent "DEADLINE_EXCEEDED: c10d TCPStore 127.0.0.1:$port"
expect_log silent "no answer within 3s"
pass "silent c10d store: failed in ${TOOK} ms: $(grep -m1 -o 'DEADLINE_EXCEEDED.*' "$WORK/silent.log" | cut -c1-160)"

run_rank batch_step SLURM_PROCID=0 SLURM_NTASKS=4 SLURM_JOB_ID=42 SLURM_JOB_NODELIST='node[01-02]'
expect_log batch_step "batch step of an sbatch script"
expect_log batch_step "srun <program>"
(( TOOK < 10000 )) || fail "batch_step: took ${TOOK} ms"
pass "sbatch batch step refused in ${TOOK} ms"
