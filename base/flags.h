// Command-line parsing for our binaries (//base:flags): absl::ParseCommandLine with a usage
// message, and --help that exits 0.
//
//   int main(int argc, char** argv) {
//     std::vector<char*> args = fairscale::base::ParseCommandLine(argc, argv, kUsage);
//
// absl's own usage flags (--help, --helpfull, --helpshort, --helpon=, --helpmatch=,
// --helppackage, --version) print their text and exit 1, which a script or a test reads as a
// failure, and without absl::SetProgramUsageMessage() they open with a warning. Here the usage
// is always set, the same texts go to stdout and the exit status is 0. Everything else (unknown
// flags, bad values: exit 1 with absl's message) is absl::ParseCommandLine's.
#pragma once

#include <vector>

#include "absl/strings/string_view.h"

namespace fairscale::base {

// Sets `usage` as the program's usage message (the first lines of --help: what the binary does,
// how to call it, the environment variables it reads), parses the flags and returns the
// positional arguments (argv[0] first), as absl::ParseCommandLine. Exits 0 after printing help.
std::vector<char*> ParseCommandLine(int argc, char** argv, absl::string_view usage);

}  // namespace fairscale::base
