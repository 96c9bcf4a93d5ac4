#!/bin/bash
# The main job under fs_launch at 1, 2 and 4 ranks: it finishes, the loss falls, and the ranks
# agree on the parameters (NO_SHARD: every rank holds all of them, so their hashes must be
# equal; FULL_SHARD: the hash of the full parameters, gathered on every rank, must be equal).
# Over tcp (train_gpt's default backend), and at 2 ranks over ucx too (UCX's TCP transport and
# its shared-memory ones), where the result must equal tcp's bitwise: the backends run the
# same algorithms.
source "$(dirname "$0")/lib.sh" "$@"

for n in 1 2 4; do
  for strategy in full_shard no_shard; do
    name="n${n}_${strategy}"
    launch "$name" "$n" -- --steps=30 --strategy="$strategy" --precision=fp32 --checkpoint_dir=none
    [[ $STATUS -eq 0 ]] || { cat "$WORK/$name.log"; fail "$name exited with $STATUS"; }
    first=$(losses "$name" | head -1 | cut -d' ' -f2)
    last=$(final_field "$name" train_loss)
    awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < f - 0.3) }' ||
      fail "$name: loss did not fall enough: $first -> $last"
    full=$(final_field "$name" full_param_fnv1a64)
    [[ $(jq -r '.[]' <<<"$full" | sort -u | wc -l) -eq 1 ]] ||
      fail "$name: ranks disagree on the full parameters: $full"
    if [[ $strategy == no_shard ]]; then
      hashes=$(final_field "$name" param_fnv1a64)
      [[ $(jq -r '.[]' <<<"$hashes" | sort -u | wc -l) -eq 1 ]] ||
        fail "$name: NO_SHARD ranks hold different parameters: $hashes"
    fi
    [[ $(jq length <<<"$full") -eq $n ]] || fail "$name: expected $n ranks in $full"
    grep -q "^\[rank 0\] " "$WORK/$name.log" || fail "$name: no rank-prefixed output"
    pass "$name: loss $first -> $last, full-parameter hash $(jq -r '.[0]' <<<"$full") on all ranks"
  done
done

tcp_hash=$(final_field n2_full_shard full_param_fnv1a64)
for tls in tcp posix,sysv,cma,self; do
  name="ucx_${tls//,/_}"
  FS_COMM_BACKEND=ucx UCX_TLS=$tls launch "$name" 2 -- --steps=30 --strategy=full_shard \
      --precision=fp32 --checkpoint_dir=none
  [[ $STATUS -eq 0 ]] || { cat "$WORK/$name.log"; fail "$name exited with $STATUS"; }
  got=$(final_field "$name" full_param_fnv1a64)
  [[ "$got" == "$tcp_hash" ]] || fail "$name: parameters $got differ from tcp's $tcp_hash"
  pass "$name: same parameters as over tcp ($(jq -r '.[0]' <<<"$got"))"
done
