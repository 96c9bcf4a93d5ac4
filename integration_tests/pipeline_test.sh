#!/bin/bash
# The main job in pipeline mode under fs_launch at 2 ranks: --pipeline_stages=2 cuts the fp32
# GPT (embed, block0, block1, lm_head) into 2 stages, one per rank, with 4 micro-batches per step
# (1F1B): it finishes, the loss falls, the banner and the final metrics record name the
# pipeline, and both stages report the same per-step loss (the pipe broadcasts it). Bad
# combinations fail before anything is launched, naming the flags.
source "$(dirname "$0")/lib.sh" "$@"
PIPE=(--pipeline_stages=2 --pipeline_chunks=4 --precision=fp32 --strategy=no_shard)

launch pipe 2 -- --steps=20 "${PIPE[@]}"
[[ $STATUS -eq 0 ]] || { cat "$WORK/pipe.log"; fail "pipeline run exited with $STATUS"; }
grep -q "pipe 2 stages (layers 2+2) x 1 replica, 1f1b, 4 micro-batches" "$WORK/pipe.log" ||
  { cat "$WORK/pipe.log"; fail "the banner does not name the pipeline"; }
mode=$(final_field pipe mode)
[[ "$mode" == *"pipe 2 stages"* ]] || fail "the final record's mode is $mode"
first=$(losses pipe | head -1 | cut -d' ' -f2)
last=$(final_field pipe train_loss)
awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < f - 0.3) }' ||
  fail "loss did not fall enough: $first -> $last"
[[ $(losses pipe | wc -l) -eq 20 ]] || fail "expected 20 training records"
pass "pipeline 2 stages: loss $first -> $last, mode $mode"

for bad in --precision=bf16 --strategy=full_shard --pipeline_schedule=zb --checkpoint_dir=/tmp/x; do
  out=$("$TRAIN_GPT" "${TINY[@]}" --out_dir="$WORK/bad" "${PIPE[@]}" "$bad" 2>&1) &&
    fail "$bad was accepted"
  flag=${bad#--} && flag=${flag%%=*}
  grep -q "$flag" <<<"$out" || fail "$bad: the error does not name $flag: $out"
  grep -q "pipeline_" <<<"$out" || fail "$bad: the error does not name the pipeline flag: $out"
  pass "$bad: $out"
done
