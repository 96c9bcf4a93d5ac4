#!/usr/bin/env bash
# Fails when a backend-free library reaches a backend, or //comm:interface reaches LibTorch.
set -euo pipefail
paths="$1"
interface_deps="$2"
if [[ -s "$paths" ]]; then
  echo "A backend-free library depends on a comm backend; the path(s):" >&2
  cat "$paths" >&2
  exit 1
fi
if grep -E '^@torch|^//(comm/(tcp|ucx|nccl|inproc)|fsdp|oss)' "$interface_deps" >&2; then
  echo "//comm:interface must depend on Abseil only (above)." >&2
  exit 1
fi
trace_deps="${3:-}"
if [[ -n "$trace_deps" ]] && grep -E '^@torch' "$trace_deps" >&2; then
  echo "//trace must not depend on LibTorch (above)." >&2
  exit 1
fi
echo "deps OK: $(wc -l < "$interface_deps") targets under //comm:interface, no backend paths"
