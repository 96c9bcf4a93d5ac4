#!/bin/bash
# Resume at another world size under fs_launch: 4 ranks train to step 6 (sharded checkpoint at
# step 6: rank0000r.shard x 4 + manifest.json + COMPLETE) and stop; 2 ranks resume from it and
# finish step 12. The resumed run must say it resumed at step 6 from 4 ranks, the full-parameter
# hash it gathers right after loading must equal the one the 4-rank run recorded at its save
# (the trainer also fails the resume itself otherwise), and it ends with a sharded 2-rank
# checkpoint. Then a checkpoint in the older per-rank local format ("rank_files") is refused at
# another world size with an error naming the format.
source "$(dirname "$0")/lib.sh" "$@"
JOB=(--steps=12 --checkpoint_every=6 --strategy=full_shard --precision=bf16)
CK="$WORK/reshard/checkpoints"

launch reshard 4 -- "${JOB[@]}" --stop_after=6
[[ $STATUS -eq 0 ]] || { cat "$WORK/reshard.log"; fail "4-rank part exited with $STATUS"; }
cp "$WORK/reshard.log" "$WORK/reshard4.log"
for r in 0 1 2 3; do
  [[ -f "$CK/step_00000006/rank0000$r.shard" ]] || fail "no rank0000$r.shard at step 6"
done
[[ -f "$CK/step_00000006/manifest.json" && -f "$CK/step_00000006/COMPLETE" ]] ||
  fail "step 6 has no manifest.json or COMPLETE"
cp -r "$CK" "$WORK/old_format"   # for the last check

launch reshard 2 -- "${JOB[@]}" --resume=required
[[ $STATUS -eq 0 ]] || { cat "$WORK/reshard.log"; fail "2-rank resume exited with $STATUS"; }
expect_resumed reshard 6 4 2
saved=$SAVED_HASH
[[ $(losses reshard | wc -l) -eq 12 ]] || fail "expected 12 training records"
[[ -n $(final_field reshard val_loss) && $(final_field reshard val_loss) != null ]] ||
  fail "the resumed run has no final record"
for r in 0 1; do
  [[ -f "$CK/step_00000012/rank0000$r.shard" ]] || fail "no 2-rank shard rank0000$r at step 12"
done
[[ ! -f "$CK/step_00000012/rank00002.shard" ]] || fail "step 12 has a third shard"
pass "4 -> 2 ranks: resumed at step 6, full parameters $saved as saved, finished step 12"

# An older (per-rank local format) checkpoint: resumable only at the world size that wrote it.
# (its files are rank0.pt .. rank3.pt: the marker names exactly those, as the reader demands)
OLD="$WORK/old_format/step_00000006"
for r in 0 1 2 3; do cp "$OLD/rank0000$r.shard" "$OLD/rank$r.pt"; done
jq '.format = "rank_files" | .files = [.files[0:4] | to_entries[] | .value.name = "rank\(.key).pt" | .value]' \
  "$OLD/COMPLETE" >"$WORK/COMPLETE.old"
mv "$WORK/COMPLETE.old" "$OLD/COMPLETE"
launch old 2 -- "${JOB[@]}" --resume=required --checkpoint_dir="$WORK/old_format"
[[ $STATUS -ne 0 ]] || fail "a local-format checkpoint of 4 ranks resumed at 2"
grep -q "per-rank local format (rank_files" "$WORK/old.log" ||
  { cat "$WORK/old.log"; fail "the error does not name the local format"; }
pass "old format: $(grep -m1 -o "per-rank local format.*" "$WORK/old.log" | head -c 200)"
