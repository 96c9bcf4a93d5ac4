#!/bin/bash
# The main job in pipeline mode with FSDP inside the stages under fs_launch: 4 ranks run 2 stages
# (balanced by size) x 2 replicas, each stage FULL_SHARD over its 2 replicas, stage forwards
# checkpointed for all but the last micro-batch, to step 6 (a sharded checkpoint per stage:
# model/stage<s>/rank0000{0,1}.shard + manifest.json, and COMPLETE) and stop; 2 ranks (2 stages x 1
# replica) resume from it and finish step 12. The resumed run must say it resumed at step 6 from
# 4 ranks, the stage-0 full-parameter hash gathered after loading must equal the one recorded at
# the save, every loss is finite and the loss falls, and step 12 holds a 1-replica checkpoint.
source "$(dirname "$0")/lib.sh" "$@"
JOB=(--steps=12 --checkpoint_every=6 --precision=fp32 --strategy=full_shard --pipeline_stages=2
     --pipeline_chunks=4 --pipeline_balance=size --checkpoint_activations=except_last)
CK="$WORK/pf/checkpoints"

launch pf 4 -- "${JOB[@]}" --stop_after=6
[[ $STATUS -eq 0 ]] || { cat "$WORK/pf.log"; fail "4-rank part exited with $STATUS"; }
grep -q "x 2 replicas (FSDP FULL_SHARD), 1f1b, 4 micro-batches" "$WORK/pf.log" ||
  { cat "$WORK/pf.log"; fail "the banner does not name the pipeline with FSDP"; }
for s in 0 1; do
  for f in rank00000.shard rank00001.shard manifest.json; do
    [[ -f "$CK/step_00000006/model/stage$s/$f" ]] || fail "no model/stage$s/$f at step 6"
  done
done
[[ -f "$CK/step_00000006/COMPLETE" ]] || fail "step 6 has no COMPLETE"
[[ $(jq -r .items.model.kind "$CK/step_00000006/COMPLETE") == stages/fsdp_sharded ]] ||
  fail "step 6's model item is $(jq -r .items.model.kind "$CK/step_00000006/COMPLETE")"

launch pf 2 -- "${JOB[@]}" --resume=required
[[ $STATUS -eq 0 ]] || { cat "$WORK/pf.log"; fail "2-rank resume exited with $STATUS"; }
expect_resumed pf 6 4 2
saved=$SAVED_HASH
[[ $(losses pf | wc -l) -eq 12 ]] || fail "expected 12 training records"
losses pf | awk '{ if ($2 != $2 + 0 || $2 == "nan" || $2 == "inf") exit 1 }' ||
  fail "a loss is not finite: $(losses pf | tr '\n' ' ')"
first=$(losses pf | head -1 | cut -d' ' -f2)
last=$(final_field pf train_loss)
awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < f - 0.3) }' ||
  fail "loss did not fall enough: $first -> $last"
for s in 0 1; do
  [[ -f "$CK/step_00000012/model/stage$s/rank00000.shard" ]] || fail "no stage$s 1-replica shard at step 12"
  [[ ! -f "$CK/step_00000012/model/stage$s/rank00001.shard" ]] || fail "step 12 stage$s has a second shard"
done
pass "2x2 pipeline+FSDP -> 2x1 ($(grep -o "pipe 2 stages (layers [0-9+]*)" "$WORK/pf.log" | head -1)): resumed at step 6, stage-0 parameters $saved as saved, loss $first -> $last"
