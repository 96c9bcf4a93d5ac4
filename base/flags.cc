#include "base/flags.h"

#include <cstdlib>
#include <iostream>

#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/usage.h"

namespace fairscale::base {

std::vector<char*> ParseCommandLine(int argc, char** argv, absl::string_view usage) {
  absl::SetProgramUsageMessage(usage);
  // Abseil 20220623 has no public parse-without-usage entry point (ParseAbseilFlagsOnly came
  // later), so this is the one place that calls its internals: parse, then handle the usage flags
  // ourselves for the exit status.
  namespace fi = absl::flags_internal;
  std::vector<char*> positional =
      fi::ParseCommandLineImpl(argc, argv, fi::ArgvListAction::kRemoveParsedArgs,
                               fi::UsageFlagsAction::kIgnoreUsage,
                               fi::OnUndefinedFlag::kAbortIfUndefined);
  if (fi::HandleUsageFlags(std::cout, absl::ProgramUsageMessage()) >= 0) {
    std::cout.flush();
    std::exit(0);
  }
  return positional;
}

}  // namespace fairscale::base
