#!/bin/bash
# The main job in pipeline mode under fs_launch at 2 ranks: --pipeline_stages=2 cuts the fp32
# GPT (embed, block0, block1, lm_head) into 2 stages, one per rank, with 4 micro-batches per step
# (1F1B): it finishes, the loss falls, the banner and the final metrics record name the
# pipeline. A run stopped at step 12 and resumed from its step-10 checkpoint (each rank saved its
# stage and its Adam state) gives bitwise the same 20 losses and final parameters. Bad
# combinations fail before anything is launched, naming the flags. The same with interleaved 1F1B
# (2 virtual stages per rank): loss falls, stop + resume is bitwise. (FSDP inside the stages:
# pipeline_fsdp_test.sh.)
source "$(dirname "$0")/lib.sh" "$@"
PIPE=(--pipeline_stages=2 --pipeline_chunks=4 --precision=fp32 --strategy=no_shard)

launch pipe 2 -- --steps=20 "${PIPE[@]}"
[[ $STATUS -eq 0 ]] || { cat "$WORK/pipe.log"; fail "pipeline run exited with $STATUS"; }
grep -q "pipe 2 stages (layers 2+2) x 1 replica (all-reduce), 1f1b, 4 micro-batches" "$WORK/pipe.log" ||
  { cat "$WORK/pipe.log"; fail "the banner does not name the pipeline"; }
mode=$(final_field pipe mode)
[[ "$mode" == *"pipe 2 stages"* ]] || fail "the final record's mode is $mode"
first=$(losses pipe | head -1 | cut -d' ' -f2)
last=$(final_field pipe train_loss)
awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < f - 0.3) }' ||
  fail "loss did not fall enough: $first -> $last"
[[ $(losses pipe | wc -l) -eq 20 ]] || fail "expected 20 training records"
pass "pipeline 2 stages: loss $first -> $last, mode $mode"

launch split 2 -- --steps=20 "${PIPE[@]}" --checkpoint_every=5 --stop_after=12
[[ $STATUS -eq 0 ]] || { cat "$WORK/split.log"; fail "first part exited with $STATUS"; }
launch split 2 -- --steps=20 "${PIPE[@]}" --checkpoint_every=5 --resume=required
[[ $STATUS -eq 0 ]] || { cat "$WORK/split.log"; fail "resumed part exited with $STATUS"; }
grep -q "resumed at step 10" "$WORK/split.log" || { cat "$WORK/split.log"; fail "did not resume at step 10"; }
diff <(losses pipe) <(losses split) || fail "per-step losses differ after the resume"
a=$(final_field pipe param_fnv1a64)
b=$(final_field split param_fnv1a64)
[[ "$a" == "$b" ]] || fail "final parameters differ after the resume: $a vs $b"
pass "stop at 12 + resume from 10: 20 identical losses, stage parameters $b"

# Interleaved 1F1B: 2 ranks x 2 virtual stages (rank 0: embed, block1; rank 1: block0, lm_head);
# the loss falls, and a run stopped at 12 and resumed from 10 matches bitwise.
INTER=("${PIPE[@]}" --pipeline_schedule=interleaved --pipeline_virtual_stages=2)
launch inter 2 -- --steps=20 "${INTER[@]}"
[[ $STATUS -eq 0 ]] || { cat "$WORK/inter.log"; fail "interleaved run exited with $STATUS"; }
grep -qF "pipe 2 stages x 2 virtual (layers 1+1+1+1) x 1 replica (all-reduce), interleaved, 4 micro-batches" \
  "$WORK/inter.log" || { cat "$WORK/inter.log"; fail "the banner does not name the interleaving"; }
first=$(losses inter | head -1 | cut -d' ' -f2)
last=$(final_field inter train_loss)
awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < f - 0.3) }' ||
  fail "interleaved: loss did not fall enough: $first -> $last"
launch isplit 2 -- --steps=20 "${INTER[@]}" --checkpoint_every=5 --stop_after=12
[[ $STATUS -eq 0 ]] || { cat "$WORK/isplit.log"; fail "interleaved first part exited with $STATUS"; }
launch isplit 2 -- --steps=20 "${INTER[@]}" --checkpoint_every=5 --resume=required
[[ $STATUS -eq 0 ]] || { cat "$WORK/isplit.log"; fail "interleaved resumed part exited with $STATUS"; }
diff <(losses inter) <(losses isplit) || fail "interleaved: per-step losses differ after the resume"
a=$(final_field inter param_fnv1a64)
b=$(final_field isplit param_fnv1a64)
[[ "$a" == "$b" ]] || fail "interleaved: final parameters differ after the resume: $a vs $b"
pass "interleaved 2 x 2 virtual: loss $first -> $last; stop at 12 + resume from 10 identical, stage parameters $b"

for bad in --precision=bf16 --data_parallel=sdp --pipeline_schedule=zb --pipeline_chunks=99 \
    --pipeline_balance=time --checkpoint_activations=every:2 --pipeline_virtual_stages=2; do
  out=$("$TRAIN_GPT" "${TINY[@]}" --out_dir="$WORK/bad" "${PIPE[@]}" "$bad" 2>&1) &&
    fail "$bad was accepted"
  flag=${bad#--} && flag=${flag%%=*}
  grep -q "$flag" <<<"$out" || fail "$bad: the error does not name $flag: $out"
  grep -q "pipeline_" <<<"$out" || fail "$bad: the error does not name the pipeline flag: $out"
  pass "$bad: $out"
done
