#!/bin/bash
# The main job under fs_launch at 2 ranks (FULL_SHARD, bf16) with --checkpoint_activations=all
# (every block's forward recomputed in backward, inside its FSDP unit) and
# --optimizer_offload=disk (each rank's Adam state in <out_dir>/offload/rank<r>.fso, streamed in
# small chunks): the loss falls; every per-step loss and the final parameters equal those of a run
# without both flags, bitwise (neither changes the arithmetic); the offload files exist; a run
# stopped at step 12 with blocks 0, 2, ... checkpointed and resumed from its step-10 checkpoint with
# every block checkpointed matches too (neither setting is part of a checkpoint's config). Bad
# values fail before anything is launched, naming the flag.
source "$(dirname "$0")/lib.sh" "$@"
JOB=(--steps=20 --checkpoint_every=5 --strategy=full_shard --precision=bf16)
BOTH=(--checkpoint_activations=all --optimizer_offload=disk --offload_chunk_bytes=4096)

launch plain 2 -- "${JOB[@]}"
[[ $STATUS -eq 0 ]] || { cat "$WORK/plain.log"; fail "plain run exited with $STATUS"; }
launch both 2 -- "${JOB[@]}" "${BOTH[@]}"
[[ $STATUS -eq 0 ]] || { cat "$WORK/both.log"; fail "checkpointed + offloaded run exited with $STATUS"; }
grep -q "checkpointed blocks: all, Adam state on disk in $WORK/both/offload" "$WORK/both.log" ||
  { cat "$WORK/both.log"; fail "the banner does not name both settings"; }

first=$(losses both | head -1 | cut -d' ' -f2)
last=$(final_field both train_loss)
awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < f - 0.3) }' ||
  fail "loss did not fall enough: $first -> $last"
diff <(losses plain) <(losses both) || fail "per-step losses differ from the plain run"
a=$(final_field plain param_fnv1a64)
b=$(final_field both param_fnv1a64)
[[ "$a" == "$b" ]] || fail "final parameters differ: plain $a, checkpointed + offloaded $b"
for r in 0 1; do
  f="$WORK/both/offload/rank$r.fso"
  [[ -s "$f" ]] || { ls -la "$WORK/both" "$WORK/both/offload" || true; fail "no offload file $f"; }
done
pass "checkpointing + offload: loss $first -> $last, 20 losses and parameters $a as without;" \
     "$(ls "$WORK/both/offload" | tr '\n' ' ')in $WORK/both/offload"

launch split 2 -- "${JOB[@]}" "${BOTH[@]}" --checkpoint_activations=every:2 --stop_after=12
[[ $STATUS -eq 0 ]] || { cat "$WORK/split.log"; fail "first part exited with $STATUS"; }
launch split 2 -- "${JOB[@]}" "${BOTH[@]}" --resume=required
[[ $STATUS -eq 0 ]] || { cat "$WORK/split.log"; fail "resumed part exited with $STATUS"; }
grep -q "resumed at step 10" "$WORK/split.log" || { cat "$WORK/split.log"; fail "did not resume at step 10"; }
diff <(losses plain) <(losses split) || fail "per-step losses differ after the resume"
c=$(final_field split param_fnv1a64)
[[ "$a" == "$c" ]] || fail "final parameters differ after the resume: plain $a, resumed $c"
pass "stop at 12 (every:2) + resume from 10 (all), offloaded: 20 identical losses, parameters $c"

for bad in --checkpoint_activations=every:0 --optimizer_offload=ram; do
  out=$("$TRAIN_GPT" "${TINY[@]}" --out_dir="$WORK/bad" "$bad" 2>&1) && fail "$bad was accepted"
  flag=${bad#--} && flag=${flag%%=*}
  grep -q "$flag '" <<<"$out" || fail "$bad: the error does not name the flag: $out"
  pass "$bad: $out"
done
