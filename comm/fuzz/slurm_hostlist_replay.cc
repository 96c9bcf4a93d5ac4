// Replays the host-list fuzz target without libFuzzer on every test run: seeds (the forms Slurm
// writes, and broken ones), then a fixed number of deterministic mutations of them (the same
// inputs every run, so a failure reproduces; the failing input is printed first).
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

const std::vector<std::string> kSeeds = {
    "node01", "node[01-04,07]", "a[1-2],b3", "gpu-[9-11]x", "r[1-2]-n[1,3]", "n[0-999]",
    "h.example.org", "x_[007-010]", "a[1-3]b[1-3]c[1-3]", "[1-2]", "a[]", "a[2-1]", "a[1-",
    "a]", "a,,b", ",", "", "a[1-2][3-4]", "n[000000000000000001-000000000000000003]",
    "a[99999999999999999999]", "a[1-100000]", "a[1-100][1-100]", "a b", "a[1,2-3,4-4]"};

std::string Mutate(std::mt19937_64& rng) {
  static const char kAlphabet[] = "[],-0123456789abz._ ";
  std::string s = kSeeds[rng() % kSeeds.size()];
  const int rounds = 1 + static_cast<int>(rng() % 4);
  for (int r = 0; r < rounds; ++r) {
    const size_t pos = s.empty() ? 0 : rng() % (s.size() + 1);
    switch (rng() % 5) {
      case 0:  // insert a character of the grammar
        s.insert(pos, 1, kAlphabet[rng() % (sizeof(kAlphabet) - 1)]);
        break;
      case 1:  // erase one
        if (pos < s.size()) s.erase(pos, 1);
        break;
      case 2:  // any byte
        if (pos < s.size()) s[pos] = static_cast<char>(rng());
        break;
      case 3: {  // splice in part of another seed
        const std::string& other = kSeeds[rng() % kSeeds.size()];
        if (!other.empty()) s.insert(pos, other.substr(rng() % other.size(), 1 + rng() % 8));
        break;
      }
      case 4:  // repeat a piece (long lists, many groups)
        if (!s.empty()) {
          const size_t from = rng() % s.size();
          const std::string piece = s.substr(from, 1 + rng() % 8);
          for (int k = static_cast<int>(rng() % 8); k >= 0; --k) s.insert(pos, piece);
        }
        break;
    }
  }
  return s;
}

}  // namespace

int main() {
  std::mt19937_64 rng(20261201);
  size_t n = 0;
  auto run = [&n](const std::string& s) {
    std::fprintf(stderr, "%s", "");  // keep the order of a crash's output
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
    ++n;
  };
  for (const std::string& s : kSeeds) run(s);
  for (int i = 0; i < 50000; ++i) run(Mutate(rng));
  std::printf("slurm_hostlist fuzz replay: %zu inputs, all checks held\n", n);
  return 0;
}
