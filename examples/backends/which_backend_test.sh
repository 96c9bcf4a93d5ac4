#!/usr/bin/env bash
# which_backend linked three ways: FS_COMM_BACKEND picks among the linked backends, unset picks
# the highest-priority one, and an unlinked name fails with the registry's list of linked ones.
set -euo pipefail
tcp_bin="$1" ucx_bin="$2" all_bin="$3"
export UCX_TLS=tcp  # loopback only under block-network; UCX's shared memory is tested in comm/ucx

# run BINARY BACKEND(or -) EXPECTED_EXIT: prints and returns the output.
run() {
  local bin="$1" backend="$2" want_rc="$3" out rc
  set +e
  if [[ "$backend" == - ]]; then
    out=$(env -u FS_COMM_BACKEND timeout 60 "$bin" 2>&1)
  else
    out=$(FS_COMM_BACKEND="$backend" timeout 60 "$bin" 2>&1)
  fi
  rc=$?
  set -e
  echo "--- $(basename "$bin") FS_COMM_BACKEND=$backend (exit $rc)" >&2
  echo "$out" >&2
  if [[ "$rc" -ne "$want_rc" ]]; then
    echo "FAIL: expected exit $want_rc, got $rc" >&2
    exit 1
  fi
  echo "$out"
}

expect() {  # expect OUTPUT SUBSTRING
  if ! grep -qF -- "$2" <<< "$1"; then
    echo "FAIL: output lacks '$2'" >&2
    exit 1
  fi
}

# Each binary lists exactly what it links, highest priority first.
out=$(run "$tcp_bin" - 0)
expect "$out" "linked backends (highest priority first): tcp"$'\n'
expect "$out" "chosen backend: tcp"
out=$(run "$ucx_bin" - 0)
expect "$out" "linked backends (highest priority first): ucx"$'\n'
expect "$out" "chosen backend: ucx"
linked=$(FS_COMM_BACKEND=none timeout 60 "$all_bin" 2>/dev/null |
  sed -n 's/^linked backends (highest priority first): //p' || true)
# nccl is in all_backends only under --config=cuda; it then has the highest priority, and this
# demo's host buffers are not for it, so the unset case is checked without --config=cuda only.
if [[ "$linked" == "tcp, ucx, inproc" ]]; then
  out=$(run "$all_bin" - 0)
  expect "$out" "chosen backend: tcp"
elif [[ "$linked" == "nccl, tcp, ucx, inproc" ]]; then
  echo "nccl linked (--config=cuda): not running the default-backend case on host buffers" >&2
else
  echo "FAIL: all_backends links '$linked'" >&2
  exit 1
fi

# FS_COMM_BACKEND selects among the linked ones.
for b in tcp ucx inproc; do
  out=$(run "$all_bin" "$b" 0)
  expect "$out" "chosen backend: $b"
  expect "$out" "all_reduce over 2 ranks [$b]: {3, 30} OK"
done

# Naming an unlinked backend fails and lists what is linked.
out=$(run "$tcp_bin" ucx 1)
expect "$out" "comm backend 'ucx' is not linked into this binary; linked: tcp"
out=$(run "$ucx_bin" tcp 1)
expect "$out" "comm backend 'tcp' is not linked into this binary; linked: ucx"
out=$(run "$all_bin" mpi 1)
expect "$out" "comm backend 'mpi' is not linked into this binary; linked: ${linked}"
echo "which_backend: all cases OK"
