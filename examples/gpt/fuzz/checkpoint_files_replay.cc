// Replays the checkpoint-files fuzz target without libFuzzer on every test run: the seeds (valid
// markers of the current format and of the old ones, metrics files with every record kind, and broken ones), then a fixed
// number of deterministic mutations (the same inputs every run, so a failure reproduces).
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

// The first byte picks the reader: even = COMPLETE, odd = metrics.jsonl.
const std::vector<std::string> kSeeds = {
    std::string("\x00", 1) +
        R"({"format":"fairscale.train_state.v1","step":7,"world_size":2,"items":{"model":)"
        R"({"kind":"fsdp_sharded","files":[{"name":"rank00000.shard","bytes":10,)"
        R"("fnv1a64":"00000000000000aa"}]},"trainer":{"kind":"json","files":[]}},)"
        R"("metadata":{"config":{"steps":20,"batch":8},"full_param_fnv1a64":"0123456789abcdef"}})",
    std::string("\x00", 1) +
        R"({"format":"fairscale.train_state.v1","step":7,"world_size":1,"items":{},)"
        R"("metadata":{"config":[],"full_param_fnv1a64":7}})",
    std::string("\x00", 1) +
        R"({"step":7,"world_size":2,"format":"rank_files","config":{"steps":20,"batch":8},)"
        R"("trainer_state":{},"files":[{"name":"rank0.pt","bytes":10,"fnv1a64":"00000000000000aa"},)"
        R"({"name":"rank1.pt","bytes":10,"fnv1a64":"00000000000000bb"}]})",
    std::string("\x00", 1) +
        R"({"step":7,"world_size":1,"format":"fsdp_sharded","config":{},"trainer_state":)"
        R"({"loss_scale":65536.0,"param_fnv1a64":"0123456789abcdef"},"files":[{"name":"rank00000.shard",)"
        R"("bytes":1,"fnv1a64":"0000000000000001"},{"name":"manifest.json","bytes":2,"fnv1a64":"0000000000000002"}]})",
    std::string("\x00", 1) + R"({"step":7,"world_size":-1,"config":{},"files":[]})",
    std::string("\x00", 1) + R"({"step":7,"world_size":1,"config":{},"files":[{"name":"../x","bytes":1,"fnv1a64":"01"}]})",
    std::string("\x00", 1) + R"({"step":7,"world_size":1,"format":"pipe","config":[],"files":[{"name":"/etc/passwd"}]})",
    std::string("\x00", 1) + R"([[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]])",
    std::string("\x00", 1) + "not json",
    std::string("\x29", 1) +
        "{\"step\":1,\"loss\":2.5}\n{\"step\":2,\"loss\":\"NaN\"}\n{\"step\":3,\"loss\":null}\n"
        "{\"step\":4,\"type\":\"eval\",\"loss\":\"Infinity\"}\n{\"step\":5,\"type\":\"final\"}\n"
        "{\"step\":6,\"type\":\"sample\",\"text\":\"x\"}\ngarbage\n{\"step\":\"7\"}\n[1,2]\n"
        "{\"step\":8,\"type\":3}\n{\"step\":9,\"loss\":[1]}\n{\"step\":99999999999999999999}\n",
    std::string("\x01", 1) + "{\"step\":-3}\n\n\n{\"step\":-20,\"loss\":-1e308}\n",
};

std::string Mutate(std::mt19937_64& rng) {
  static const char kAlphabet[] = "{}[]\":,0123456789-.eE \n\\nulltruefalsNaIfiy/";
  std::string s = kSeeds[rng() % kSeeds.size()];
  const int rounds = 1 + static_cast<int>(rng() % 6);
  for (int r = 0; r < rounds; ++r) {
    const size_t pos = s.size() <= 1 ? s.size() : 1 + rng() % s.size();
    switch (rng() % 6) {
      case 0:
        s.insert(pos, 1, kAlphabet[rng() % (sizeof(kAlphabet) - 1)]);
        break;
      case 1:
        if (pos < s.size()) s.erase(pos, 1 + rng() % 4);
        break;
      case 2:
        if (pos < s.size()) s[pos] = static_cast<char>(rng());
        break;
      case 3: {  // splice a piece of another seed
        const std::string& other = kSeeds[rng() % kSeeds.size()];
        if (other.size() > 1) s.insert(pos, other.substr(1 + rng() % (other.size() - 1), 1 + rng() % 40));
        break;
      }
      case 4:  // limit values
        s.insert(pos, rng() % 2 ? "18446744073709551615" : "-9223372036854775808");
        break;
      case 5:  // truncate
        if (pos < s.size()) s.resize(pos);
        break;
    }
  }
  if (!s.empty() && rng() % 3 == 0) s[0] = static_cast<char>(rng());  // the other reader
  return s;
}

}  // namespace

int main() {
  std::mt19937_64 rng(20261201);
  size_t n = 0;
  auto run = [&n](const std::string& s) {
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
    ++n;
  };
  for (const std::string& s : kSeeds) run(s);
  for (int i = 0; i < 5000; ++i) run(Mutate(rng));
  std::printf("checkpoint files fuzz replay: %zu inputs, all checks held\n", n);
  return 0;
}
