#!/usr/bin/env bash
# Fails when a backend-free library reaches a backend (//comm/tcp, ucx, nccl, inproc or
# //comm:all_backends), or //comm:interface reaches LibTorch. The control query proves the
# backend query can see those paths at all.
set -euo pipefail
paths="$1"
interface_deps="$2"
if [[ -s "$paths" ]]; then
  echo "A backend-free library depends on a comm backend; the path(s):" >&2
  cat "$paths" >&2
  exit 1
fi
if grep -E '^@libtorch|^(@[A-Za-z0-9_.-]+)?//(comm/(tcp|ucx|nccl|inproc)|comm:all_backends|fsdp|oss)' "$interface_deps" >&2; then
  echo "//comm:interface must depend on Abseil only (above)." >&2
  exit 1
fi
trace_deps="${3:-}"
if [[ -n "$trace_deps" ]] && grep -E '^@libtorch' "$trace_deps" >&2; then
  echo "//trace must not depend on LibTorch (above)." >&2
  exit 1
fi
control="${4:-}"
if [[ -n "$control" ]]; then
  for backend in //comm/tcp:tcp //comm/ucx:ucx //comm/inproc:inproc //comm/nccl:nccl //comm:all_backends; do
    if ! grep -qxE "(@[A-Za-z0-9_.-]+)?$backend" "$control"; then
      echo "control query: which_backend_all has no path to $backend; is the check still wired?" >&2
      cat "$control" >&2
      exit 1
    fi
  done
fi
echo "deps OK: $(wc -l < "$interface_deps") targets under //comm:interface, no backend paths"
