#!/usr/bin/env bash
# Fails when the targets visible to every repository (`bazel query 'attr(visibility,
# "//visibility:public", //...)'`) are not exactly the supported API listed in
# tools/public_api.bzl, or when README.md's table of it names other targets. Run by .ci/run; runs
# alone too (a query: loading only, no compiling). It cannot be a `bazel test`: only a query of
# //... sees a target that no list names yet.
#
#   tools/check_public_api.sh            # from any directory
#   BAZEL=bazel tools/check_public_api.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bazel=${BAZEL:-./bazelw}
list=tools/public_api.bzl

# Entries are lines `    "//pkg:name",  # comment`; "//pkg" stands for "//pkg:pkg".
expected=$(sed -nE 's#^ *"(//[^"]*)",.*#\1#p' "$list" |
  sed -E '/:/!s#^//(.*/)?([^/]+)$#&:\2#' | sort -u)
if [[ -z "$expected" ]]; then
  echo "check_public_api: no label found in $list; has its format changed?" >&2
  exit 1
fi
actual=$("$bazel" query --noshow_progress 'attr(visibility, "//visibility:public", //...)' | sort -u)
# The query must see the list's core: otherwise a broken query would read as "nothing public".
if ! grep -qx '//fsdp:fsdp' <<<"$actual"; then
  echo "check_public_api: the query did not find //fsdp:fsdp; its output:" >&2
  echo "$actual" >&2
  exit 1
fi

# README.md's table of the supported API ("### What your repository may depend on") must name
# the same targets.
readme=$(awk '/^### What your repository may depend on/{on=1; next} /^#/{on=0} on && /^\|/' README.md |
  grep -oE '`//[^`]*`' | tr -d '`' | sed -E '/:/!s#^//(.*/)?([^/]+)$#&:\2#' | sort -u)
if [[ "$readme" != "$expected" ]]; then
  echo "README.md's table of the supported API differs from $list (< README, > list):" >&2
  diff <(echo "$readme") <(echo "$expected") >&2 || true
  exit 1
fi

extra=$(comm -13 <(echo "$expected") <(echo "$actual"))
missing=$(comm -23 <(echo "$expected") <(echo "$actual"))
if [[ -n "$extra" || -n "$missing" ]]; then
  if [[ -n "$extra" ]]; then
    echo "public, but not in the supported API ($list):" >&2
    sed 's/^/  /' <<<"$extra" >&2
    echo "  Narrow its visibility (its own package: private; this repository: //:__subpackages__)," >&2
    echo "  or, if other repositories may depend on it, add it to $list on purpose." >&2
  fi
  if [[ -n "$missing" ]]; then
    echo "in $list, but not public (or gone):" >&2
    sed 's/^/  /' <<<"$missing" >&2
  fi
  exit 1
fi
echo "public API OK: $(wc -l <<<"$actual") public targets, all in $list"
