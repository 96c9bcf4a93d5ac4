#!/usr/bin/env python3
"""Summarizes one `bazel test` invocation: counts, skipped tests with their reasons, the slowest.

bazelw runs it after every `./bazelw test ...` (on stderr; the exit status stays Bazel's). Its
input is the invocation's own Build Event Protocol stream (`--build_event_json_file`, which
bazelw passes), so it reports exactly the test targets of this invocation, cached ones included,
never stale results of earlier runs that are still under bazel-testlogs/. From the BEP:

  - every test target (`configured` events whose kind ends in "_test rule"),
  - its status, run time and whether it was cached (`testSummary`, `testResult`),
  - the targets skipped as incompatible (`target_compatible_with`; `aborted` with SKIPPED),
  - the test.xml of each run (gtest's, or the one Bazel writes for an sh_test), from which it
    reads the test cases skipped inside a binary (GTEST_SKIP) with their message as the reason,
    and the names of failed cases.

Usage: test_summary.py --bep FILE [--testlogs DIR] [--slowest N]
Standard library only (Debian's python3).
"""

import argparse
import collections
import json
import os
import sys
import urllib.parse
import xml.etree.ElementTree as ET

_NOT_PASSED = ("FAILED", "TIMEOUT", "FLAKY", "INCOMPLETE", "REMOTE_FAILURE", "FAILED_TO_BUILD",
               "TOOL_HALTED_BEFORE_TESTING", "NO_STATUS")


def _label_dir(label):
    """//pkg/sub:name -> pkg/sub/name; @repo//pkg:name -> external/repo/pkg/name."""
    repo, _, rest = label.partition("//")
    pkg, _, name = rest.partition(":")
    parts = (["external", repo.lstrip("@")] if repo.lstrip("@") else []) + [pkg, name]
    return os.path.join(*[p for p in parts if p])


def _uri_path(uri):
    if uri.startswith("file://"):
        return urllib.parse.unquote(uri[len("file://"):])
    return None


def _fmt_secs(ms):
    s = ms / 1000.0
    if s < 60:
        return "%.1fs" % s
    return "%dm%02ds" % (int(s) // 60, int(s) % 60)


def _skip_reason(message):
    # gtest: "file.cc:123\nthe GTEST_SKIP() message" (older gtest: "file.cc:123\nSkipped\nmsg").
    lines = [l.strip() for l in (message or "").splitlines() if l.strip()]
    if lines and ":" in lines[0] and lines[0].rsplit(":", 1)[1].isdigit():
        lines = lines[1:]
    if lines and lines[0] == "Skipped":
        lines = lines[1:]
    return " ".join(lines) or "(no message)"


def _read_cases(xml_path):
    """(skipped [(case, reason)], failed [case]) from one test.xml; empty when unreadable."""
    skipped, failed = [], []
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return skipped, failed
    for case in root.iter("testcase"):
        name = case.get("name", "?")
        if case.get("classname"):
            name = "%s.%s" % (case.get("classname"), name)
        skip = case.find("skipped")
        if skip is not None or case.get("result") == "skipped":
            skipped.append((name, _skip_reason(skip.get("message") if skip is not None else "")))
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
    return skipped, failed


class Target:
    def __init__(self, label):
        self.label = label
        self.is_test = False
        self.skipped_incompatible = False
        self.built = None  # None: no targetCompleted event (the build stopped before it)
        self.status = None
        self.cached = False
        self.run_ms = 0
        self.shards = 1
        self.xmls = []


def read_bep(path):
    targets = collections.OrderedDict()
    started_ms = finished_ms = None
    exit_name = None

    def target(label):
        if label not in targets:
            targets[label] = Target(label)
        return targets[label]

    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a truncated last line (Bazel interrupted)
            eid = event.get("id", {})
            if "started" in event:
                started_ms = int(event["started"].get("startTimeMillis", 0)) or None
            elif "finished" in event:
                finished_ms = int(event["finished"].get("finishTimeMillis", 0)) or None
                exit_name = event["finished"].get("exitCode", {}).get("name")
            elif "targetConfigured" in eid and "configured" in event:
                kind = event["configured"].get("targetKind", "")
                if kind.endswith("_test rule") or "testSize" in event["configured"]:
                    target(eid["targetConfigured"]["label"]).is_test = True
            elif "targetCompleted" in eid:
                t = target(eid["targetCompleted"]["label"])
                if event.get("aborted", {}).get("reason") == "SKIPPED":
                    t.skipped_incompatible = True
                elif "completed" in event:
                    t.built = bool(event["completed"].get("success"))
                elif "aborted" in event:
                    t.built = False
            elif "testResult" in eid and "testResult" in event:
                t = target(eid["testResult"]["label"])
                for out in event["testResult"].get("testActionOutput", []):
                    if out.get("name") == "test.xml":
                        t.xmls.append((eid["testResult"], _uri_path(out.get("uri", ""))))
            elif "testSummary" in eid and "testSummary" in event:
                s = event["testSummary"]
                t = target(eid["testSummary"]["label"])
                t.status = s.get("overallStatus", "NO_STATUS")
                runs = int(s.get("totalRunCount", 1) or 1)
                t.cached = int(s.get("totalNumCached", 0) or 0) >= runs
                t.run_ms = int(s.get("totalRunDurationMillis", 0) or 0)
                t.shards = max(int(s.get("shardCount", 1) or 1), 1)
    return targets, started_ms, finished_ms, exit_name


def _xml_path(testlogs, label, result_id, uri_path):
    """The run's test.xml: the BEP's file URI, else the same run under --testlogs."""
    if uri_path and os.path.exists(uri_path):
        return uri_path
    if not testlogs:
        return uri_path
    d = os.path.join(testlogs, _label_dir(label))
    # Bazel's layout for several shards / runs: <target>/shard_S_of_N/, <target>/run_R_of_N/.
    prefixes = ("shard_%d_of_" % int(result_id.get("shard", 1)),
                "run_%d_of_" % int(result_id.get("run", 1)))
    candidates = [os.path.join(d, "test.xml")]
    if os.path.isdir(d):
        candidates += [os.path.join(d, e, "test.xml") for e in sorted(os.listdir(d))
                       if e.startswith(prefixes)]
    for candidate in candidates:
        if os.path.exists(candidate):
            return candidate
    return uri_path


def summarize(targets, started_ms, finished_ms, exit_name, testlogs, slowest, out):
    tests = [t for t in targets.values() if t.is_test]
    incompatible = [t for t in tests if t.skipped_incompatible]
    ran = [t for t in tests if t.status is not None]
    passed = [t for t in ran if t.status == "PASSED"]
    failed = [t for t in ran if t.status != "PASSED"]
    # Configured tests that got neither a result nor a skip: failed to build, or the build
    # stopped first (no --keep_going).
    not_built = [t for t in tests if t.status is None and not t.skipped_incompatible and
                 t.built is False]
    not_run = [t for t in tests if t.status is None and not t.skipped_incompatible and
               t.built is not False]

    skipped_cases = collections.OrderedDict()  # reason -> {label: [case]}
    failed_cases = {}
    for t in ran:
        seen = set()
        for result_id, uri_path in t.xmls:
            path = _xml_path(testlogs, t.label, result_id, uri_path)
            if not path:
                continue
            skipped, bad = _read_cases(path)
            for case, reason in skipped:
                if (case, reason) in seen:
                    continue
                seen.add((case, reason))
                skipped_cases.setdefault(reason, collections.OrderedDict()).setdefault(
                    t.label, []).append(case)
            if t.status != "PASSED":
                failed_cases.setdefault(t.label, []).extend(
                    c for c in bad if c not in failed_cases.get(t.label, []))

    w = out.write
    took = ""
    if started_ms and finished_ms:
        took = " in %s" % _fmt_secs(finished_ms - started_ms)
    w("== test summary: %d test targets%s%s ==\n" % (
        len(tests), took, (", bazel: %s" % exit_name) if exit_name else ""))
    counts = ["passed %d (%d cached)" % (len(passed), len([t for t in passed if t.cached])),
              "failed %d" % len(failed),
              "skipped as incompatible %d" % len(incompatible)]
    if not_built:
        counts.append("failed to build %d" % len(not_built))
    if not_run:
        counts.append("not run %d" % len(not_run))
    w("  targets: %s\n" % ", ".join(counts))
    for t in failed:
        cases = failed_cases.get(t.label, [])
        more = ""
        if cases:
            more = ": " + ", ".join(cases[:5]) + (" and %d more" % (len(cases) - 5)
                                                  if len(cases) > 5 else "")
        w("  %s %s%s\n" % (t.status.lower().replace("_", " "), t.label, more))
    for t in not_built:
        w("  failed to build %s\n" % t.label)
    for t in incompatible:
        w("  skipped %s: incompatible with the target platform (target_compatible_with)\n"
          % t.label)
    n_cases = sum(len(c) for by_label in skipped_cases.values() for c in by_label.values())
    if n_cases:
        w("  test cases skipped inside binaries: %d\n" % n_cases)
        for reason, by_label in skipped_cases.items():
            for label, cases in by_label.items():
                shown = ", ".join(cases[:3]) + (", ..." if len(cases) > 3 else "")
                w("    %s: %d in %s (%s)\n" % (reason, len(cases), label, shown))
    timed = sorted((t for t in ran if t.run_ms), key=lambda t: (-t.run_ms, t.label))[:slowest]
    if timed:
        w("  slowest %d test targets (test time; cached: the time of the run it reuses):\n"
          % len(timed))
        for t in timed:
            notes = []
            if t.shards > 1:
                notes.append("%d shards" % t.shards)
            if t.cached:
                notes.append("cached")
            if t.status != "PASSED":
                notes.append(t.status)
            w("    %8s  %s%s\n" % (_fmt_secs(t.run_ms), t.label,
                                   "  (%s)" % ", ".join(notes) if notes else ""))


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bep", required=True, help="the invocation's --build_event_json_file")
    p.add_argument("--testlogs", default="bazel-testlogs",
                   help="where to look for a test.xml the BEP's file URI does not reach")
    p.add_argument("--slowest", type=int, default=10)
    args = p.parse_args(argv)
    try:
        targets, started_ms, finished_ms, exit_name = read_bep(args.bep)
    except OSError as e:
        sys.stderr.write("test_summary: cannot read the build event file: %s\n" % e)
        return 1
    summarize(targets, started_ms, finished_ms, exit_name, args.testlogs, args.slowest,
              sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
