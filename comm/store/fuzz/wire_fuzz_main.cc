// Replays the wire fuzz target without libFuzzer, so every CI run exercises the decoder: each
// seed file given on the command line, then a fixed number of deterministic mutations of the
// seeds (same inputs on every run, so a failure reproduces), then random valid frames.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "comm/store/store.h"
#include "comm/store/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

namespace wire = fairscale::comm::wire;

void Run(const std::string& input) {
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()), input.size());
}

// Values that sit on the decoder's limits, written into header length fields.
uint64_t Interesting(std::mt19937_64& rng) {
  static const uint64_t kValues[] = {0,
                                     1,
                                     7,
                                     8,
                                     12,
                                     fairscale::comm::kMaxStoreKeyBytes,
                                     fairscale::comm::kMaxStoreKeyBytes + 1,
                                     fairscale::comm::kMaxStoreValueBytes,
                                     fairscale::comm::kMaxStoreValueBytes + 1,
                                     0xffffffffull,
                                     uint64_t{1} << 60,
                                     ~uint64_t{0}};
  return kValues[rng() % (sizeof(kValues) / sizeof(kValues[0]))];
}

std::string Mutate(const std::vector<std::string>& seeds, std::mt19937_64& rng) {
  std::string s = seeds[rng() % seeds.size()];
  const int rounds = 1 + static_cast<int>(rng() % 4);
  for (int r = 0; r < rounds; ++r) {
    const size_t pos = s.empty() ? 0 : rng() % s.size();
    switch (rng() % 8) {
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
        if (!other.empty()) {
          const size_t from = rng() % other.size();
          s.insert(pos, other.substr(from, 1 + rng() % 64));
        }
        break;
      }
      case 6: {  // an interesting value in a header length field of the first frame
        if (s.size() >= wire::kHeaderBytes) {
          const bool key_len = rng() % 2 == 0;
          uint64_t v = Interesting(rng);
          const size_t off = key_len ? 12 : 16;
          const int width = key_len ? 4 : 8;
          for (int i = 0; i < width; ++i) s[off + i] = static_cast<char>(v >> (8 * i));
        }
        break;
      }
      case 7:  // duplicate the input (pipelined frames)
        if (s.size() < 4096) s += s;
        break;
    }
  }
  return s;
}

std::string RandomKey(std::mt19937_64& rng) {
  std::string k(1 + rng() % 12, '\0');
  for (char& c : k) c = static_cast<char>(rng());
  return k;
}

// A stream of valid frames with random fields (round-trips must hold for all of them).
std::string RandomValidFrames(std::mt19937_64& rng) {
  std::string s;
  const int n = 1 + static_cast<int>(rng() % 4);
  const bool requests = rng() % 2 == 0;
  for (int i = 0; i < n; ++i) {
    const uint32_t id = static_cast<uint32_t>(rng());
    absl::Status st;
    if (requests) {
      const std::string key = RandomKey(rng);
      switch (rng() % 8) {
        case 0: st = wire::EncodeSet(id, key, RandomKey(rng), &s); break;
        case 1: st = wire::EncodeGet(id, key, absl::Milliseconds(rng() % 100000), &s); break;
        case 2: st = wire::EncodeAdd(id, key, static_cast<int64_t>(rng()), &s); break;
        case 3: st = wire::EncodeCompareSet(id, key, RandomKey(rng), RandomKey(rng), &s); break;
        case 4: st = wire::EncodeDelete(id, key, &s); break;
        case 5: st = wire::EncodeCheck(id, key, &s); break;
        case 6:
          st = wire::EncodeWait(id, {key, RandomKey(rng)}, absl::InfiniteDuration(), &s);
          break;
        case 7: st = wire::EncodeHello(id, RandomKey(rng), &s); break;
      }
    } else {
      switch (rng() % 5) {
        case 0: wire::EncodeOk(id, &s); break;
        case 1: wire::EncodeValue(id, RandomKey(rng), &s); break;
        case 2: wire::EncodeInt(id, static_cast<int64_t>(rng()), &s); break;
        case 3: wire::EncodeBool(id, rng() % 2 == 0, &s); break;
        case 4: wire::EncodeError(id, absl::AbortedError(RandomKey(rng)), &s); break;
      }
    }
    if (!st.ok()) {
      std::fprintf(stderr, "encoding a valid frame failed: %s\n", st.ToString().c_str());
      std::abort();
    }
  }
  return s;
}

}  // namespace

// Usage: wire_fuzz_test [--iterations=N] SEED_FILE...
int main(int argc, char** argv) {
  int iterations = 20000;
  std::vector<std::string> seeds;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--iterations=", 0) == 0) {
      if (!absl::SimpleAtoi(arg.substr(13), &iterations)) return 2;
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
    std::fprintf(stderr, "usage: %s [--iterations=N] SEED_FILE...\n", argv[0]);
    return 2;
  }
  for (const std::string& s : seeds) Run(s);
  std::mt19937_64 rng(0x5eed);  // Fixed: every run replays the same inputs.
  for (int i = 0; i < iterations; ++i) Run(Mutate(seeds, rng));
  for (int i = 0; i < iterations / 10; ++i) Run(RandomValidFrames(rng));
  std::printf("wire fuzz replay: %zu seeds, %d mutations, %d valid streams: OK\n", seeds.size(),
              iterations, iterations / 10);
  return 0;
}
