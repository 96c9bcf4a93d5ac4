#!/usr/bin/env bash
# A full disk during a save: the own loop's checkpoints (one every 5 steps) go to a 48 KiB tmpfs
# (in a mount namespace of this test's own) that fills up after a few. The failing save is an
# error on every rank naming the step, the file and "No space left on device"; the checkpoint
# before it stays complete and intact, and a run started again on a roomier disk resumes from it
# and ends bitwise equal to an uninterrupted run.
set -euo pipefail
launch="$1"
loop="$2"
tmp="${TEST_TMPDIR:-/tmp}/own_loop_enospc_$$"
mkdir -p "$tmp/small"
args=(--steps=30 --save_every=5)
run() { timeout 300 "$launch" --nproc_per_node=2 --master_port=0 -- "$loop" "$@"; }
run --ckpt="$tmp/straight" "${args[@]}" > "$tmp/straight.txt" 2>&1 || { cat "$tmp/straight.txt"; exit 1; }
want=$(grep -o "rank [01] step 30 param_hash [0-9a-f]*" "$tmp/straight.txt" | sort)
for async in true false; do
  rm -rf "$tmp/small"/* "$tmp/copy"
  # In a mount namespace: the tmpfs exists for this command only; the checkpoint is copied out.
  if unshare -m bash -c "
      mount -t tmpfs -o size=48k tmpfs '$tmp/small' || exit 77
      $(declare -f run); launch='$launch'; loop='$loop'
      run --ckpt='$tmp/small/ckpt' ${args[*]} --async=$async > '$tmp/full_$async.txt' 2>&1
      status=\$?
      cp -a '$tmp/small/ckpt' '$tmp/copy'
      exit \$status"; then
    cat "$tmp/full_$async.txt"; echo "async=$async: the run on a full disk succeeded" >&2; exit 1
  else
    status=$?
  fi
  if [[ $status -eq 77 ]]; then echo "cannot mount a tmpfs here (not root?)" >&2; exit 1; fi
  grep -q "No space left on device" "$tmp/full_$async.txt" ||
    { cat "$tmp/full_$async.txt"; echo "async=$async: no 'No space left on device'" >&2; exit 1; }
  failed=$(grep -m1 -oE "checkpoint save of step [0-9]+" "$tmp/full_$async.txt" | grep -oE "[0-9]+$" || true)
  [[ -n "$failed" ]] || { cat "$tmp/full_$async.txt"; echo "async=$async: no failed step named" >&2; exit 1; }
  last=$((failed - 5))
  failed_dir=$(printf "step_%08d" "$failed")
  last_dir=$(printf "step_%08d" "$last")
  grep -qE "'[^']*$tmp/small/ckpt/$failed_dir/[^']*': No space left on device" "$tmp/full_$async.txt" ||
    { cat "$tmp/full_$async.txt"; echo "async=$async: the error names no file of $failed_dir" >&2; exit 1; }
  [[ $last -ge 5 && -f "$tmp/copy/$last_dir/COMPLETE" && ! -f "$tmp/copy/$failed_dir/COMPLETE" ]] ||
    { ls -R "$tmp/copy"; echo "async=$async: expected $last_dir complete, $failed_dir not" >&2; exit 1; }
  # Resume from the copy (room enough now): from step 5, to the uninterrupted run's parameters.
  run --ckpt="$tmp/copy" "${args[@]}" --async=$async > "$tmp/resumed_$async.txt" 2>&1 ||
    { cat "$tmp/resumed_$async.txt"; exit 1; }
  grep -q "rank 0 resumed at step $last" "$tmp/resumed_$async.txt" ||
    { cat "$tmp/resumed_$async.txt"; echo "async=$async: did not resume at step $last" >&2; exit 1; }
  got=$(grep -o "rank [01] step 30 param_hash [0-9a-f]*" "$tmp/resumed_$async.txt" | sort)
  [[ "$got" == "$want" ]] || { echo "async=$async: '$got' != '$want'" >&2; exit 1; }
  echo "async=$async: No space left on device at step $failed; resumed from step $last, final parameters equal"
  grep -m1 -o "what():.*" "$tmp/full_$async.txt" | sed "s|$tmp|<tmp>|g"
done
echo PASS
