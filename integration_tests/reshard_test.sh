#!/bin/bash
# Resume at another world size under fs_launch: 4 ranks train to step 6 (sharded checkpoint at
# step 6: model/rank0000r.shard x 4 + model/manifest.json + COMPLETE) and stop; 2 ranks resume
# from it and
# finish step 12. The resumed run must say it resumed at step 6 from 4 ranks, the full-parameter
# hash it gathers right after loading must equal the one the 4-rank run recorded at its save
# (the trainer also fails the resume itself otherwise), and it ends with a sharded 2-rank
# checkpoint. Then a step directory in train_gpt's per-rank format from before //train_state
# ("rank_files": rank<r>.pt, COMPLETE without "format") is refused with an error naming the format.
source "$(dirname "$0")/lib.sh" "$@"
JOB=(--steps=12 --checkpoint_every=6 --strategy=full_shard --precision=bf16)
CK="$WORK/reshard/checkpoints"

launch reshard 4 -- "${JOB[@]}" --stop_after=6
[[ $STATUS -eq 0 ]] || { cat "$WORK/reshard.log"; fail "4-rank part exited with $STATUS"; }
cp "$WORK/reshard.log" "$WORK/reshard4.log"
for r in 0 1 2 3; do
  [[ -f "$CK/step_00000006/model/rank0000$r.shard" ]] || fail "no model/rank0000$r.shard at step 6"
done
[[ -f "$CK/step_00000006/model/manifest.json" && -f "$CK/step_00000006/COMPLETE" ]] ||
  fail "step 6 has no model/manifest.json or COMPLETE"
cp -r "$CK" "$WORK/old_format"   # for the last check

launch reshard 2 -- "${JOB[@]}" --resume=required
[[ $STATUS -eq 0 ]] || { cat "$WORK/reshard.log"; fail "2-rank resume exited with $STATUS"; }
expect_resumed reshard 6 4 2
saved=$SAVED_HASH
[[ $(losses reshard | wc -l) -eq 12 ]] || fail "expected 12 training records"
[[ -n $(final_field reshard val_loss) && $(final_field reshard val_loss) != null ]] ||
  fail "the resumed run has no final record"
for r in 0 1; do
  [[ -f "$CK/step_00000012/model/rank0000$r.shard" ]] || fail "no 2-rank shard rank0000$r at step 12"
done
[[ ! -f "$CK/step_00000012/model/rank00002.shard" ]] || fail "step 12 has a third shard"
pass "4 -> 2 ranks: resumed at step 6, full parameters $saved as saved, finished step 12"

# A step directory in train_gpt's per-rank format from before //train_state: refused by name.
OLD="$WORK/old_format/step_00000006"
rm -rf "$OLD"/*
for r in 0 1 2 3; do echo "rank $r" >"$OLD/rank$r.pt"; done
jq -n '{step: 6, world_size: 4, config: {}, files: [range(4) | {name: "rank\(.).pt", bytes: 7, fnv1a64: "0000000000000001"}]}' \
  >"$OLD/COMPLETE"
launch old 2 -- "${JOB[@]}" --resume=required --checkpoint_dir="$WORK/old_format"
[[ $STATUS -ne 0 ]] || fail "a checkpoint of the old per-rank format resumed"
grep -q "is in train_gpt's format \"rank_files\" from before the job used //train_state" "$WORK/old.log" ||
  { cat "$WORK/old.log"; fail "the error does not name the old format"; }
pass "old format: $(grep -m1 -o "is in train_gpt's format.*" "$WORK/old.log" | head -c 200)"
