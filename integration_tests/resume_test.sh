#!/bin/bash
# Resume equality under fs_launch: 20 steps in one go (checkpoints saved synchronously), and
# 10 steps (a checkpoint every 5, saved in the background: --async_checkpoint) then
# --resume=required to step 20, give the same per-step losses and the same final parameters,
# bitwise. Then resuming from a checkpoint whose rank file was corrupted fails with an error
# naming that file, and a step directory without COMPLETE (an interrupted save) is skipped.
source "$(dirname "$0")/lib.sh" "$@"
JOB=(--steps=20 --checkpoint_every=5 --strategy=full_shard --precision=bf16)

launch whole 2 -- "${JOB[@]}"
[[ $STATUS -eq 0 ]] || { cat "$WORK/whole.log"; fail "uninterrupted run exited with $STATUS"; }
launch split 2 -- "${JOB[@]}" --async_checkpoint --stop_after=10
[[ $STATUS -eq 0 ]] || { cat "$WORK/split.log"; fail "first half exited with $STATUS"; }
launch split 2 -- "${JOB[@]}" --async_checkpoint --resume=required
[[ $STATUS -eq 0 ]] || { cat "$WORK/split.log"; fail "resumed half exited with $STATUS"; }
grep -q "resum" "$WORK/split.log" || fail "the second half did not say it resumed"

diff <(losses whole) <(losses split | sort -n -u) || fail "per-step losses differ after resume"
a=$(final_field whole param_fnv1a64)
b=$(final_field split param_fnv1a64)
[[ "$a" == "$b" ]] || fail "final parameters differ: uninterrupted $a, resumed $b"
pass "resume: 20 identical losses, parameters $a"

# A corrupted rank file of the newest checkpoint: a clear error naming it.
cp -r "$WORK/split" "$WORK/corrupt"
newest=$(ls -d "$WORK/corrupt/checkpoints"/step_* | sort | tail -1)
printf 'garbage' | dd of="$newest/model/rank00001.shard" bs=1 seek=100 conv=notrunc status=none
launch corrupt 2 -- "${JOB[@]}" --resume=required
[[ $STATUS -ne 0 ]] || fail "resume from a corrupted checkpoint succeeded"
grep -q "$newest/model/rank00001.shard" "$WORK/corrupt.log" ||
  { cat "$WORK/corrupt.log"; fail "the error does not name $newest/model/rank00001.shard"; }
pass "corrupt checkpoint: $(grep -m1 "rank00001.shard" "$WORK/corrupt.log")"
