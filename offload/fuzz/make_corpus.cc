// Writes the seeds of //offload/fuzz:disk_tier_fuzz_test (control byte + a real offload file
// made by DiskTier::Create / WriteChunk / Commit) into the directory given as its argument:
//
//   ./bazelw run //offload/fuzz:make_corpus -- "$PWD/offload/fuzz/corpus"
//
// The files hold fresh random sessions, so a rerun rewrites every seed.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "offload/disk_tier.h"
#include "offload/fuzz/fuzz_input.h"

namespace {

namespace fo = fairscale::offload;
namespace fz = fairscale::offload::fuzz;

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "make_corpus: %s\n", std::string(s.message()).c_str());
    std::exit(1);
  }
}

// Creates a tier of `specs` (list `which`), fills every tensor with a counting pattern, commits
// unless told not to, and writes control byte + file to dir/name.
void Seed(const std::string& dir, const std::string& name, int which, int64_t chunk_elems,
          bool commit, uint8_t control) {
  const std::string tmp = absl::StrCat(dir, "/.make_corpus_", getpid(), ".fso");
  {
    auto t = fo::DiskTier::Create(tmp, fz::ExpectedSpecs(which), chunk_elems, /*sync=*/false);
    Check(t.status());
    for (size_t i = 0; i < (*t)->specs().size(); ++i) {
      std::vector<char> data(static_cast<size_t>((*t)->specs()[i].nbytes()));
      for (size_t k = 0; k < data.size(); ++k) data[k] = static_cast<char>(k * 7 + i);
      Check((*t)->WriteTensor(i, data.data()));
    }
    if (commit) Check((*t)->Commit());
    Check((*t)->Close());
  }
  std::ifstream in(tmp, std::ios::binary);
  std::stringstream file;
  file << in.rdbuf();
  std::remove(tmp.c_str());
  std::ofstream out(absl::StrCat(dir, "/", name), std::ios::binary | std::ios::trunc);
  out.put(static_cast<char>(control));
  out << file.str();
  std::printf("%s: %zu bytes\n", name.c_str(), file.str().size() + 1);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTPUT_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  using M = fz::SessionMode;
  Seed(dir, "two_committed", 0, 4, true, fz::Control(0, fz::kFixAll, M::kAnyVerifyAll));
  Seed(dir, "two_exact_session", 0, 4, true, fz::Control(0, fz::kFixAll, M::kExact));
  Seed(dir, "two_stale_session", 0, 4, true, fz::Control(0, fz::kFixAll, M::kStale));
  Seed(dir, "two_lazy_chunk1", 0, 1, true, fz::Control(0, fz::kFixAll, M::kAnyLazy));
  Seed(dir, "two_writing", 0, 4, false, fz::Control(0, fz::kFixAll, M::kAnyVerifyAll));
  Seed(dir, "two_no_fixups", 0, 4, true, fz::Control(0, 0, M::kAnyVerifyAll));
  Seed(dir, "two_one_too_many", 0, 4, true, fz::Control(3, fz::kFixAll, M::kAnyVerifyAll));
  Seed(dir, "empty_list", 1, 8, true, fz::Control(1, fz::kFixAll, M::kAnyVerifyAll));
  Seed(dir, "bf16_and_empty", 2, 4, true, fz::Control(2, fz::kFixAll, M::kExact));
  return 0;
}
