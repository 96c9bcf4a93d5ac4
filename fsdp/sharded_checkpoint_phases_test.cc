// The phases of a sharded checkpoint save (sharded_checkpoint.h: snapshot, write, manifest),
// the pieces of an asynchronous save: composed by hand at world sizes 1-4 they write the same
// bytes as save_sharded_checkpoint, which loads at another world size; a snapshot is a copy
// (training on before the write changes nothing in the checkpoint) and reuses its buffers; a
// failed write is DATA_LOSS naming the file and leaves no file behind; write runs on another
// thread while the training thread trains.
#include <ATen/ops/equal.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/types.h"
#include "fsdp/sharded_checkpoint.h"
#include "fsdp/state_dict.h"
#include "fsdp/test_util.h"
#include "fsdp/testing/checkpoint_helpers.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"

namespace fairscale::fsdp {
namespace {

using testing::Check;
using testing::ExpectAllOk;
using testing::MakeModel;
using testing::OptimizerKind;
using testing::SameDict;
using testing::TrainSteps;

constexpr int kSaveAt = 3;

std::string FreshDir(const std::string& name) {
  const std::string dir = fairscale::testing::UniqueTmpPath(name);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::set<std::string> FileNames(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    out.insert(e.path().filename());
  }
  return out;
}

// Phase 3 after this rank's phase 2 gave `mine`: the summaries gathered over `comm` (what a
// checkpoint manager does over its own communicator), then rank 0 writes the manifest.
absl::Status Commit(const ShardedCheckpointSnapshot& snap,
                    const absl::StatusOr<ShardFileSummary>& mine, comm::Communicator& comm,
                    const std::string& dir) {
  FS_RETURN_IF_ERROR(mine.status());
  FS_RETURN_IF_ERROR(Check(mine->name == absl::StrFormat("rank%05d.shard", snap.rank()),
                           "summary name " + mine->name));
  const int64_t fields[3] = {mine->bytes, static_cast<int64_t>(mine->fnv1a),
                             static_cast<int64_t>(mine->header_fnv1a)};
  std::vector<int64_t> all(3 * comm.size());
  FS_RETURN_IF_ERROR(
      comm.AllGather(comm::MakeConstBuffer(fields, 3), comm::MakeBuffer(all.data(), all.size()))
          .Wait());
  if (comm.rank() != 0) return absl::OkStatus();
  std::vector<ShardFileSummary> summaries;
  for (int r = 0; r < comm.size(); ++r) {
    summaries.push_back({absl::StrFormat("rank%05d.shard", r), all[3 * r],
                         static_cast<uint64_t>(all[3 * r + 1]),
                         static_cast<uint64_t>(all[3 * r + 2])});
  }
  return write_sharded_manifest(snap, summaries, dir);
}

// Phase 2 on this rank, then Commit.
absl::Status WriteAndCommit(const ShardedCheckpointSnapshot& snap, comm::Communicator& comm,
                            const std::string& dir) {
  return Commit(snap, snap.write(dir), comm, dir);
}

absl::Status SameOptim(const FullOptimState& a, const FullOptimState& b, const std::string& what) {
  FS_RETURN_IF_ERROR(Check(a.kind == b.kind && a.state.size() == b.state.size() &&
                               a.param_groups.size() == b.param_groups.size(),
                           what + ": kind, groups or parameters differ"));
  for (const auto& [name, p] : a.state) {
    const auto it = b.state.find(name);
    FS_RETURN_IF_ERROR(Check(it != b.state.end() && it->second.step == p.step &&
                                 it->second.tensors.size() == p.tensors.size(),
                             what + ": state of '" + name + "' differs"));
    for (const auto& [tname, t] : p.tensors) {
      FS_RETURN_IF_ERROR(Check(at::equal(t, it->second.tensors.at(tname)),
                               what + ": '" + name + "/" + tname + "' differs"));
    }
  }
  return absl::OkStatus();
}

// Loads `dir` at `world` ranks and compares with `sd` and `osd` (rank 0).
void ExpectLoadsAs(const std::string& dir, int world, const StateDict& sd,
                   const FullOptimState& osd) {
  ExpectAllOk(comm::testing::RunInprocRanks(
                  world,
                  [&](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
                    auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
                    auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
                    load_sharded_checkpoint(model, opt.get(), dir);
                    const StateDict loaded = full_state_dict(model, true);
                    const FullOptimState loaded_osd = full_optim_state_dict(model, *opt, true);
                    if (rank != 0) return absl::OkStatus();
                    FS_RETURN_IF_ERROR(SameDict(loaded, sd, "loaded model"));
                    return SameOptim(loaded_osd, osd, "loaded optimizer");
                  }),
              absl::StrCat("load ", dir, " at ", world));
}

TEST(FsdpShardedCheckpointPhases, ComposedByHandWriteTheBytesOfSaveAndLoadElsewhere) {
  for (int world = 1; world <= 4; ++world) {
    const ShardingStrategy strategy = world == 2   ? ShardingStrategy::kShardGradOp
                                      : world == 3 ? ShardingStrategy::kNoShard
                                                   : ShardingStrategy::kFullShard;
    const std::string saved_dir = FreshDir("save");
    const std::string phased_dir = FreshDir("phased");
    StateDict sd;
    FullOptimState osd;
    ExpectAllOk(comm::testing::RunInprocRanks(
                    world,
                    [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
                      auto model = MakeModel(comm, strategy, true);
                      auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
                      TrainSteps(model, *opt, 0, kSaveAt, rank, w);
                      save_sharded_checkpoint(model, opt.get(), saved_dir);
                      const ShardedCheckpointSnapshot snap =
                          snapshot_sharded_checkpoint(model, opt.get());
                      FS_RETURN_IF_ERROR(Check(snap.rank() == rank && snap.world_size() == w &&
                                                   snap.bytes() > 0,
                                               "snapshot rank, world size, bytes"));
                      FS_RETURN_IF_ERROR(WriteAndCommit(snap, *comm, phased_dir));
                      StateDict full = full_state_dict(model, true);
                      FullOptimState full_osd = full_optim_state_dict(model, *opt, true);
                      if (rank == 0) {
                        sd = std::move(full);
                        osd = std::move(full_osd);
                      }
                      return absl::OkStatus();
                    }),
                absl::StrCat("save at ", world));
    const std::set<std::string> names = FileNames(saved_dir);
    EXPECT_EQ(names.size(), static_cast<size_t>(world) + 1) << world;  // rank files + manifest
    EXPECT_EQ(FileNames(phased_dir), names) << world;
    for (const std::string& name : names) {
      EXPECT_TRUE(ReadFile(saved_dir + "/" + name) == ReadFile(phased_dir + "/" + name))
          << name << " differs at world " << world;
    }
    ExpectLoadsAs(phased_dir, world % 4 + 1, sd, osd);
  }
}

TEST(FsdpShardedCheckpointPhases, SnapshotIsACopyTrainingOnChangesNothingInIt) {
  const std::string dir = FreshDir("copy");
  StateDict sd;
  FullOptimState osd;
  ExpectAllOk(
      comm::testing::RunInprocRanks(
          2,
          [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
            auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
            TrainSteps(model, *opt, 0, kSaveAt, rank, w);
            StateDict before = full_state_dict(model, true);
            FullOptimState before_osd = full_optim_state_dict(model, *opt, true);
            const ShardedCheckpointSnapshot snap = snapshot_sharded_checkpoint(model, opt.get());
            TrainSteps(model, *opt, kSaveAt, kSaveAt + 1, rank, w);  // in place: shards, Adam
            const StateDict after = full_state_dict(model, true);
            const FullOptimState after_osd = full_optim_state_dict(model, *opt, true);
            FS_RETURN_IF_ERROR(WriteAndCommit(snap, *comm, dir));
            if (rank != 0) return absl::OkStatus();
            // The step changed every parameter and the Adam state (else the test shows nothing).
            FS_RETURN_IF_ERROR(Check(!SameDict(after, before, "after").ok() &&
                                         !SameOptim(after_osd, before_osd, "after").ok(),
                                     "the extra step changed nothing"));
            sd = std::move(before);
            osd = std::move(before_osd);
            return absl::OkStatus();
          }),
      "snapshot, step, write");
  ExpectLoadsAs(dir, 3, sd, osd);
}

TEST(FsdpShardedCheckpointPhases, ReuseKeepsTheBuffersAndTakesTheNewValues) {
  ExpectAllOk(
      comm::testing::RunInprocRanks(
          2,
          [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
            auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
            TrainSteps(model, *opt, 0, 1, rank, w);
            ShardedCheckpointSnapshot first = snapshot_sharded_checkpoint(model, opt.get());
            std::vector<const void*> ptrs;
            std::vector<at::Tensor> old_values;
            for (const auto& r : first.records()) {
              ptrs.push_back(r.value.data_ptr());
              old_values.push_back(r.value.clone());
            }
            const int64_t bytes = first.bytes();
            TrainSteps(model, *opt, 1, 2, rank, w);
            const ShardedCheckpointSnapshot second =
                snapshot_sharded_checkpoint(model, opt.get(), &first);
            const ShardedCheckpointSnapshot fresh = snapshot_sharded_checkpoint(model, opt.get());
            FS_RETURN_IF_ERROR(Check(first.world_size() == 0 && first.records().empty(),
                                     "the reused snapshot is left empty"));
            FS_RETURN_IF_ERROR(Check(second.records().size() == ptrs.size() &&
                                         fresh.records().size() == ptrs.size() &&
                                         second.bytes() == bytes && !ptrs.empty(),
                                     "record count"));
            bool changed = false;
            for (size_t i = 0; i < ptrs.size(); ++i) {
              const auto& r = second.records()[i];
              FS_RETURN_IF_ERROR(Check(r.value.data_ptr() == ptrs[i],
                                       "record '" + r.key + "' was reallocated"));
              FS_RETURN_IF_ERROR(Check(r.key == fresh.records()[i].key &&
                                           at::equal(r.value, fresh.records()[i].value),
                                       "record '" + r.key + "' holds old values"));
              // Copies, not views of the model's tensors: two snapshots share no memory.
              FS_RETURN_IF_ERROR(Check(r.value.data_ptr() != fresh.records()[i].value.data_ptr(),
                                       "record '" + r.key + "' aliases another snapshot's"));
              changed = changed || !at::equal(r.value, old_values[i]);
            }
            return Check(changed, "the second step changed no record");
          }),
      "reuse");
}

TEST(FsdpShardedCheckpointPhases, FailedWriteIsDataLossNamingTheFileAndLeavesNothing) {
  ExpectAllOk(
      comm::testing::RunInprocRanks(
          1,
          [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
            auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
            TrainSteps(model, *opt, 0, 1, rank, w);
            const ShardedCheckpointSnapshot snap = snapshot_sharded_checkpoint(model, opt.get());
            const auto expect_data_loss = [&](const std::string& dir,
                                              const std::string& why) -> absl::Status {
              absl::StatusOr<ShardFileSummary> s = snap.write(dir);
              const std::string file = dir + "/rank00000.shard";
              FS_RETURN_IF_ERROR(Check(s.status().code() == absl::StatusCode::kDataLoss &&
                                           s.status().message().find(file) != std::string::npos &&
                                           s.status().message().find(why) != std::string::npos,
                                       absl::StrCat("write to '", dir,
                                                    "': ", s.status().ToString())));
              return Check(!std::filesystem::exists(file) &&
                               !std::filesystem::exists(absl::StrCat(file, ".tmp.", getpid())),
                           "a file was left in '" + dir + "'");
            };
            FS_RETURN_IF_ERROR(
                expect_data_loss(fairscale::testing::UniqueTmpPath("missing"), "No such file"));

            // A write failing midway (as a full disk would, with its errno): a file size limit.
            const std::string dir = FreshDir("limited");
            struct rlimit old;
            ::getrlimit(RLIMIT_FSIZE, &old);
            struct rlimit small = old;
            small.rlim_cur = 512;
            ::signal(SIGXFSZ, SIG_IGN);
            ::setrlimit(RLIMIT_FSIZE, &small);
            absl::Status limited = expect_data_loss(dir, "File too large");
            ::setrlimit(RLIMIT_FSIZE, &old);
            FS_RETURN_IF_ERROR(limited);

            // A read-only directory (root writes anyway).
            if (::geteuid() != 0) {
              const std::string ro = FreshDir("readonly");
              ::chmod(ro.c_str(), 0555);
              FS_RETURN_IF_ERROR(expect_data_loss(ro, "Permission denied"));
            }
            // The snapshot is intact: it still writes.
            return snap.write(FreshDir("after")).status();
          }),
      "failed writes");
}

TEST(FsdpShardedCheckpointPhases, WriteRunsOnAnotherThreadWhileTheTrainingThreadTrains) {
  const std::string dir = FreshDir("thread");
  StateDict sd;
  FullOptimState osd;
  ExpectAllOk(
      comm::testing::RunInprocRanks(
          3,
          [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
            auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
            TrainSteps(model, *opt, 0, kSaveAt, rank, w);
            StateDict before = full_state_dict(model, true);
            FullOptimState before_osd = full_optim_state_dict(model, *opt, true);
            const ShardedCheckpointSnapshot snap = snapshot_sharded_checkpoint(model, opt.get());
            absl::StatusOr<ShardFileSummary> written = absl::UnknownError("not run");
            std::thread writer([&] { written = snap.write(dir); });
            // Collectives on the training communicator meanwhile.
            TrainSteps(model, *opt, kSaveAt, kSaveAt + 2, rank, w);
            writer.join();
            FS_RETURN_IF_ERROR(Commit(snap, written, *comm, dir));
            if (rank == 0) {
              sd = std::move(before);
              osd = std::move(before_osd);
            }
            return absl::OkStatus();
          }),
      "write on a thread");
  ExpectLoadsAs(dir, 2, sd, osd);
}

}  // namespace
}  // namespace fairscale::fsdp
