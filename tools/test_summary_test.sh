#!/usr/bin/env bash
# tools/test_summary.py over a fake invocation (testdata/test_summary: a build event file and a
# bazel-testlogs tree), against the expected summary; then bazelw with a stand-in `bazel` that
# writes that build event file: the summary follows Bazel's output and bazelw exits with Bazel's
# status.
set -euo pipefail
data=tools/testdata/test_summary
work=${TEST_TMPDIR:-$(mktemp -d)}

# The fixture's file URIs point at @TESTLOGS@; one (store_test) points at a file that is not
# there, as for a result cached by another output base: it is found under --testlogs instead.
# testlogs/oss/stale_test is an earlier invocation's result and must not appear.
cp -rL "$data/testlogs" "$work/testlogs"
sed "s|@TESTLOGS@|$work/testlogs|g" "$data/bep.json" > "$work/bep.json"
python3 tools/test_summary.py --bep "$work/bep.json" --testlogs "$work/testlogs" > "$work/out.txt"
if ! diff -u "$data/expected.txt" "$work/out.txt"; then
  echo "FAIL: the summary differs from $data/expected.txt (above: - expected, + actual)" >&2
  exit 1
fi
if grep -q STALE "$work/out.txt"; then
  echo "FAIL: an earlier invocation's result was summarized" >&2
  exit 1
fi
echo "summary OK"

# bazelw: a fake `bazel` (first on PATH) that checks it got the build event flag right after
# `test`, writes the fixture there and exits 3 (tests failed). dpkg-query is faked too, so the
# package check passes wherever this runs.
mkdir -p "$work/bin" "$work/ws/tools"
cat > "$work/bin/bazel" <<FAKE
#!/usr/bin/env bash
echo "fake bazel: \$*"
[[ "\$1" == test && "\$2" == --build_event_json_file=* ]] || { echo "bad args: \$*"; exit 2; }
cp "$work/bep.json" "\${2#--build_event_json_file=}"
echo "Executed 12 out of 15 tests: 11 tests pass and 2 fail locally."
exit 3
FAKE
printf '#!/bin/sh\necho "install ok installed"\n' > "$work/bin/dpkg-query"
chmod +x "$work/bin/bazel" "$work/bin/dpkg-query"
cp bazelw "$work/ws/bazelw"
cp tools/test_summary.py "$work/ws/tools/"
ln -s "$work/testlogs" "$work/ws/bazel-testlogs"
rc=0
PATH="$work/bin:$PATH" "$work/ws/bazelw" test //... > "$work/bazelw.out" 2>&1 || rc=$?
cat "$work/bazelw.out"
if [[ $rc -ne 3 ]]; then
  echo "FAIL: bazelw exited $rc, Bazel 3" >&2
  exit 1
fi
if ! grep -q "^== test summary: 15 test targets" "$work/bazelw.out"; then
  echo "FAIL: no summary after bazelw test" >&2
  exit 1
fi
# .ci/run reads Bazel's "Executed N out of M" line and counts "FAIL: " lines: the summary adds
# neither.
if [[ $(grep -cE "^Executed [0-9]+ out of" "$work/bazelw.out") -ne 1 ]] ||
   grep -qE "^(FAIL|TIMEOUT|NO STATUS|INCOMPLETE):? " "$work/bazelw.out"; then
  echo "FAIL: the summary's lines would confuse .ci/run" >&2
  exit 1
fi
# Other commands go straight to Bazel (exec), without the flag.
rc=0
PATH="$work/bin:$PATH" "$work/ws/bazelw" build //... > "$work/build.out" 2>&1 || rc=$?
if [[ $rc -ne 2 ]] || grep -q "test summary" "$work/build.out"; then
  echo "FAIL: bazelw build: exit $rc (want the fake's 2), output:" >&2
  cat "$work/build.out" >&2
  exit 1
fi
echo "bazelw OK"
