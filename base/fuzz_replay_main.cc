// main() of the gcc-built replay tests of our libFuzzer targets (//base:fuzz_replay_main): links
// against a target's LLVMFuzzerTestOneInput and runs it, with no libFuzzer, on every test run:
// each seed file named on the command line, then a fixed number of deterministic mutations of
// the seeds (the same inputs on every run, so a failure reproduces; FS_FUZZ_REPLAY_VERBOSE=1
// prints each input's index and size before running it).
//
//   foo_fuzz_test [--iterations=N] [--max_len=BYTES] SEED_FILE...
//
// The mutations are byte-level and format-blind: bit flips, random bytes, inserted, erased and
// duplicated ranges, truncation, splices of other seeds, and values that sit on typical limits
// (0, 1, 16, 32, 4096, 2^20, 2^32 - 1, 2^60, 2^64 - 1) written as little-endian 32- or 64-bit
// integers at 4-aligned offsets (the length and tag fields of binary headers).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

uint64_t Interesting(std::mt19937_64& rng) {
  static const uint64_t kValues[] = {0,    1,       16,          32,          4096,
                                     1 << 20, 0xffffffffull, uint64_t{1} << 60, ~uint64_t{0}};
  return kValues[rng() % (sizeof(kValues) / sizeof(kValues[0]))];
}

std::string Mutate(const std::vector<std::string>& seeds, size_t max_len, std::mt19937_64& rng) {
  std::string s = seeds[rng() % seeds.size()];
  const int rounds = 1 + static_cast<int>(rng() % 4);
  for (int r = 0; r < rounds; ++r) {
    const size_t pos = s.empty() ? 0 : rng() % s.size();
    switch (rng() % 9) {
      case 0:  // flip a bit
        if (!s.empty()) s[pos] = static_cast<char>(s[pos] ^ (1 << (rng() % 8)));
        break;
      case 1:  // random byte
        if (!s.empty()) s[pos] = static_cast<char>(rng());
        break;
      case 2: {  // insert random bytes
        std::string ins(1 + rng() % 16, '\0');
        for (char& c : ins) c = static_cast<char>(rng());
        s.insert(pos, ins);
        break;
      }
      case 3:  // erase a range
        if (!s.empty()) s.erase(pos, 1 + rng() % 32);
        break;
      case 4:  // truncate
        s.resize(pos);
        break;
      case 5: {  // splice in part of another seed
        const std::string& other = seeds[rng() % seeds.size()];
        if (!other.empty()) s.insert(pos, other.substr(rng() % other.size(), 1 + rng() % 64));
        break;
      }
      case 6:    // a limit value in a 32-bit field
      case 7: {  // ... or a 64-bit one
        const size_t width = r % 2 == 0 ? 4 : 8;
        if (s.size() < width) break;
        const size_t off = (rng() % (s.size() - width + 1)) & ~size_t{3};
        const uint64_t v = Interesting(rng);
        for (size_t i = 0; i < width; ++i) s[off + i] = static_cast<char>(v >> (8 * i));
        break;
      }
      case 8: {  // repeat a range (pipelined records)
        if (s.empty()) break;
        const std::string piece = s.substr(pos, 1 + rng() % 96);
        s.insert(pos, piece);
        break;
      }
    }
  }
  if (s.size() > max_len) s.resize(max_len);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  int iterations = 10000;
  int max_len = 4096;
  std::vector<std::string> seeds;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--iterations=", 0) == 0) {
      if (!absl::SimpleAtoi(arg.substr(13), &iterations) || iterations < 0) return 2;
      continue;
    }
    if (arg.rfind("--max_len=", 0) == 0) {
      if (!absl::SimpleAtoi(arg.substr(10), &max_len) || max_len < 1) return 2;
      continue;
    }
    std::ifstream in(arg, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "cannot read seed %s\n", arg.c_str());
      return 2;
    }
    std::stringstream buffer;
    buffer << in.rdbuf();
    seeds.push_back(buffer.str());
  }
  if (seeds.empty()) {
    std::fprintf(stderr, "usage: %s [--iterations=N] [--max_len=BYTES] SEED_FILE...\n", argv[0]);
    return 2;
  }
  const bool verbose = std::getenv("FS_FUZZ_REPLAY_VERBOSE") != nullptr;
  size_t index = 0;
  const auto run = [&](const std::string& input) {
    if (verbose) std::fprintf(stderr, "input %zu: %zu bytes\n", index, input.size());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()), input.size());
    ++index;
  };
  for (const std::string& s : seeds) run(s);
  std::mt19937_64 rng(0x5eed);  // Fixed: every run replays the same inputs.
  for (int i = 0; i < iterations; ++i) run(Mutate(seeds, static_cast<size_t>(max_len), rng));
  std::printf("fuzz replay: %zu seeds and %d mutations, all checks held\n", seeds.size(),
              iterations);
  return 0;
}
