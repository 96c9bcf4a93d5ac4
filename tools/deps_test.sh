#!/usr/bin/env bash
# The architecture checks over genquery outputs (tools/BUILD.bazel). Arguments: name=path pairs.
#   backend_paths          must be empty: no feature library reaches a backend (or anything else
#                          a binary links to choose one, e.g. //comm/torch:c10d_store)
#   feature_libraries      the libraries that check covers, derived from tools/public_api.bzl:
#                          must hold the core ones, and no forbidden target
#   forbidden_targets      must hold every backend and //comm/torch:c10d_store (alwayslink found)
#   backend_paths_control  the same query with a library that links //comm/tcp added: must find it
#   control_paths          which_backend_all reaches every backend
#   interface_deps         //comm:interface depends on Abseil only
#   trace_deps             //trace does not depend on LibTorch
# Labels may carry a repository name (@fairscale_cpp//...) when run from a consumer.
set -euo pipefail
declare -A f
for arg in "$@"; do f[${arg%%=*}]=${arg#*=}; done
R='(@[A-Za-z0-9_.-]+)?'
failed=0
fail() { echo "FAIL: $*" >&2; failed=1; }
has() { grep -qxE "$R$2" "$1"; }  # has FILE LABEL: FILE lists LABEL (label is a regex)

backends=(//comm/tcp:tcp //comm/ucx:ucx //comm/inproc:inproc //comm/nccl:nccl //comm:all_backends)

# Negative controls first: without them an empty backend_paths proves nothing.
if [[ ! -s "${f[feature_libraries]}" ]]; then
  fail "the query derived no feature library from tools/public_api.bzl"
fi
for lib in //comm:interface //comm:registry //fsdp:fsdp //oss:oss //pipe:pipe //trace:trace; do
  has "${f[feature_libraries]}" "$lib" || fail "feature_libraries lacks $lib (is the query still wired?)"
done
for target in "${backends[@]}" //comm/torch:c10d_store; do
  has "${f[forbidden_targets]}" "$target" || fail "forbidden_targets lacks $target"
  if has "${f[feature_libraries]}" "$target"; then fail "feature_libraries holds $target"; fi
done
for target in //tools:backend_user_control //comm/tcp:tcp; do
  has "${f[backend_paths_control]}" "$target" ||
    fail "the control query does not find $target: the backend query cannot see paths"
done
for target in "${backends[@]}"; do
  has "${f[control_paths]}" "$target" || fail "which_backend_all has no path to $target"
done
if ((failed)); then
  echo "controls (above) failed; the outputs:" >&2
  for name in feature_libraries forbidden_targets backend_paths_control control_paths; do
    echo "--- $name" >&2
    cat "${f[$name]}" >&2
  done
  exit 1
fi

if [[ -s "${f[backend_paths]}" ]]; then
  echo "A feature library depends on a comm backend (or a link-time registration); the path(s):" >&2
  cat "${f[backend_paths]}" >&2
  exit 1
fi
if grep -E "^@libtorch|^$R//(comm/(tcp|ucx|nccl|inproc)|comm:all_backends|fsdp|oss)" \
    "${f[interface_deps]}" >&2; then
  echo "//comm:interface must depend on Abseil only (above)." >&2
  exit 1
fi
if grep -E '^@libtorch' "${f[trace_deps]}" >&2; then
  echo "//trace must not depend on LibTorch (above)." >&2
  exit 1
fi
echo "deps OK: $(wc -l < "${f[feature_libraries]}") feature libraries reach no backend:"
sed 's/^/  /' "${f[feature_libraries]}"
echo "$(wc -l < "${f[interface_deps]}") targets under //comm:interface, none of them LibTorch"
