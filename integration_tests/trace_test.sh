#!/bin/bash
# Observability of the main job: --trace writes one Chrome trace (JSON object format, as
# Perfetto and chrome://tracing read it) with a track per rank holding forward, backward and
# optimizer spans and every collective with its bytes; --profile prints compute vs
# communication vs idle per rank.
source "$(dirname "$0")/lib.sh" "$@"

launch traced 2 -- --steps=6 --checkpoint_dir=none --trace="$WORK/trace.json" --profile
[[ $STATUS -eq 0 ]] || { cat "$WORK/traced.log"; fail "traced run exited with $STATUS"; }
T="$WORK/trace.json"
jq -e '.traceEvents | length > 0' "$T" >/dev/null || fail "no traceEvents in $T"
# Every event has the fields a viewer needs; complete events have a duration >= 0.
jq -e '[.traceEvents[] | select(has("ph") and has("pid") and has("tid") and has("name")
        and (.ph == "M" or has("ts")))] | length == (input | .traceEvents | length)' "$T" "$T" \
  >/dev/null || fail "events without ph/pid/tid/name/ts"
jq -e '[.traceEvents[] | select(.ph == "X" and (.dur < 0))] | length == 0' "$T" >/dev/null ||
  fail "negative durations"
for rank in 0 1; do
  jq -e --argjson r "$rank" '[.traceEvents[] | select(.ph == "M" and .name == "process_name"
        and .pid == $r and .args.name == "rank \($r)")] | length == 1' "$T" >/dev/null ||
    fail "no process_name 'rank $rank' track"
  for phase in forward backward optimizer; do
    n=$(jq --argjson r "$rank" --arg p "$phase" \
        '[.traceEvents[] | select(.pid == $r and .ph == "X" and .name == $p)] | length' "$T")
    [[ $n -eq 6 ]] || fail "rank $rank: $n '$phase' spans, want 6 (one per step)"
  done
  for op in all_gather reduce_scatter; do
    n=$(jq --argjson r "$rank" --arg op "$op" '[.traceEvents[] | select(.pid == $r and
          .ph == "X" and .cat == "comm" and .name == $op and (.args.bytes > 0))] | length' "$T")
    (( n > 0 )) || fail "rank $rank: no $op with bytes"
  done
done
grep -q "profile" "$WORK/traced.log" || fail "no profile table"
for rank in 0 1; do
  grep -Eq "^\[rank 0\] +$rank +" "$WORK/traced.log" ||
    { cat "$WORK/traced.log"; fail "profile table has no row for rank $rank"; }
done
pass "trace: $(jq '.traceEvents | length' "$T") events, 2 rank tracks; profile:"
grep -A4 "^\[rank 0\] profile" "$WORK/traced.log"
