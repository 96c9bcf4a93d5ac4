// Writes the seeds of //fsdp/fuzz:sharded_checkpoint_fuzz_test (fuzz_input.h: control byte, then
// a manifest, a rank file, or a directory's manifest and rank files) into the directory given as
// its argument; every rank file is a real one made by ShardFileWriter:
//
//   ./bazelw run //fsdp/fuzz:make_corpus -- "$PWD/fsdp/fuzz/corpus"
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "fsdp/fuzz/fuzz_input.h"
#include "fsdp/internal/shard_file.h"

namespace {

namespace fz = fairscale::fsdp::fuzz;
namespace fi = fairscale::fsdp::internal;

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "make_corpus: %s\n", std::string(s.message()).c_str());
    std::exit(1);
  }
}

struct Rec {
  std::string key, dtype;
  std::vector<int64_t> shape;
  int64_t begin, end;
};

// A rank file holding `recs` (element bytes: a counting pattern); returns its bytes.
std::string RankFile(const std::string& tmpdir, int rank, int world, const std::vector<Rec>& recs,
                     fi::Manifest::File* entry) {
  const std::string path = absl::StrCat(tmpdir, "/", fi::RankFileName(rank));
  auto w = fi::ShardFileWriter::Open(path, rank, world);
  Check(w.status());
  for (const Rec& r : recs) {
    const int64_t n = (r.end - r.begin) * fi::DtypeSize(r.dtype);
    std::string data(static_cast<size_t>(n), '\0');
    for (int64_t i = 0; i < n; ++i) data[i] = static_cast<char>(i * 13 + rank);
    Check((*w)->Add(r.key, r.dtype, r.shape, r.begin, r.end, data.data(), n));
  }
  auto summary = (*w)->Finish();
  Check(summary.status());
  *entry = {fi::RankFileName(rank), summary->bytes, summary->fnv1a, summary->header_fnv1a};
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  std::remove(path.c_str());
  return bytes.str();
}

void Put(const std::string& dir, const std::string& name, uint8_t control,
         const std::string& body) {
  std::ofstream out(dir + "/" + name, std::ios::binary | std::ios::trunc);
  out.put(static_cast<char>(control));
  out << body;
}

// A model of two linear layers (w [2,3] tied by "w_tied", b [3]), a Double buffer, Adam state.
fi::Manifest BaseManifest(int world) {
  fi::Manifest m;
  m.world_size = world;
  m.units = {"", "block"};
  m.params = {{"w", {2, 3}, "Float", ""}, {"w_tied", {2, 3}, "Float", "w"},
              {"b", {3}, "BFloat16", ""}};
  m.buffers = {{"running", {2}, "Double", ""}};
  m.has_optimizer = true;
  m.optimizer_kind = "adam";
  m.param_groups = {{{{"lr", 0.001}, {"eps", 1e-8}}, {"w", "b"}}};
  m.optimizer_state["w"] = {5, {"exp_avg", "exp_avg_sq"}};
  m.optimizer_state["b"] = {5, {"exp_avg"}};
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_corpus OUT_DIR\n");
    return 2;
  }
  const std::string out = argv[1];
  char tmpl[] = "/tmp/fs_fsdp_make_corpus_XXXXXX";
  const std::string tmp = ::mkdtemp(tmpl);
  const std::string sep = fz::kSeparator;

  // Two ranks: w split [0,4) | [4,6), b on rank 1, the buffer on rank 0, state split like w.
  {
    fi::Manifest m = BaseManifest(2);
    m.files.resize(2);
    const std::string r0 = RankFile(tmp, 0, 2,
                                    {{"p/w", "Float", {2, 3}, 0, 4},
                                     {"o/w/exp_avg", "Float", {2, 3}, 0, 4},
                                     {"o/w/exp_avg_sq", "Float", {2, 3}, 0, 4},
                                     {"b/running", "Double", {2}, 0, 2}},
                                    &m.files[0]);
    const std::string r1 = RankFile(tmp, 1, 2,
                                    {{"p/w", "Float", {2, 3}, 4, 6},
                                     {"o/w/exp_avg", "Float", {2, 3}, 4, 6},
                                     {"o/w/exp_avg_sq", "Float", {2, 3}, 4, 6},
                                     {"p/b", "BFloat16", {3}, 0, 3},
                                     {"o/b/exp_avg", "Float", {3}, 0, 3}},
                                    &m.files[1]);
    const std::string manifest = fi::ManifestToJson(m);
    Put(out, "dir_2ranks", fz::kModeDirectory | fz::kFixChecksums, manifest + sep + r0 + sep + r1);
    Put(out, "dir_2ranks_verify", fz::kModeDirectory | fz::kVerifyWholeFiles,
        manifest + sep + r0 + sep + r1);
    Put(out, "manifest_2ranks", fz::kModeManifest, manifest);
    Put(out, "rankfile_1", fz::kModeRankFile | fz::kFixChecksums, r1);
    // Rank 1 also holds w's [0, 4): an overlap (and w's [4, 6) nowhere on rank 0: fine).
    fi::Manifest m2 = m;
    const std::string r1_overlap = RankFile(tmp, 1, 2,
                                            {{"p/w", "Float", {2, 3}, 0, 6},
                                             {"o/w/exp_avg", "Float", {2, 3}, 4, 6},
                                             {"o/w/exp_avg_sq", "Float", {2, 3}, 4, 6},
                                             {"p/b", "BFloat16", {3}, 0, 3},
                                             {"o/b/exp_avg", "Float", {3}, 0, 3}},
                                            &m2.files[1]);
    Put(out, "dir_overlap", fz::kModeDirectory | fz::kFixChecksums,
        fi::ManifestToJson(m2) + sep + r0 + sep + r1_overlap);
  }
  // One rank, no optimizer, an empty tensor.
  {
    fi::Manifest m;
    m.world_size = 1;
    m.units = {""};
    m.params = {{"v", {4}, "Half", ""}, {"empty", {0, 5}, "Float", ""}};
    m.files.resize(1);
    const std::string r0 = RankFile(tmp, 0, 1, {{"p/v", "Half", {4}, 0, 4}}, &m.files[0]);
    Put(out, "dir_1rank", fz::kModeDirectory | fz::kFixChecksums,
        fi::ManifestToJson(m) + sep + r0);
    Put(out, "rankfile_0_unfixed", fz::kModeRankFile, r0);
  }
  // Manifests a hostile writer could leave.
  Put(out, "manifest_escape", fz::kModeManifest,
      R"({"format":"fairscale.fsdp.sharded_checkpoint.v1","world_size":1,"units":[],)"
      R"("params":[],"buffers":[],"files":[{"name":"../../etc/passwd","bytes":1,)"
      R"("fnv1a":"00","header_fnv1a":"00"}]})");
  Put(out, "manifest_types", fz::kModeManifest,
      R"({"format":"fairscale.fsdp.sharded_checkpoint.v1","world_size":1e300,"units":[1],)"
      R"("params":[{"name":"x","shape":[-1,4294967296,4294967296],"dtype":"Int"}],)"
      R"("buffers":{},"files":[],"optimizer":{"kind":3,"param_groups":[{"options":)"
      R"({"lr":"fast"},"params":[]}],"state":{"x":{"step":-1,"tensors":["a","a"]}}}})");
  ::rmdir(tmp.c_str());
  return 0;
}
