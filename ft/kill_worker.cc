// One rank of //ft:kill_test's job (started by fs_launch --replica_group_size): FaultTolerantHsdp
// over tcp (FSDP FULL_SHARD in each replica group, the cross-group average per quorum) on a small
// f64 MLP, with a FileStore in --dir as the job's store, and SIGKILLs of itself where the test
// says (--kills). At the end each rank's last incarnation writes <dir>/result.<rank>.json
// (atomically): its incarnation, its step history (per attempt: step, epoch, groups, committed,
// whether it received the state, one draw of torch's default generator after each commit, the
// commit's wall time), the rows it trained on by its own count (an add_state: a joiner gets it by
// transfer), and the full parameters. An error: one line on stderr, exit status 3.
//
// Environment (fs_launch): RANK, WORLD_SIZE, FS_REPLICA_GROUP_SIZE, FS_RESTART_COUNT.
// Flags: --dir=D --steps=N --step_ms=M --heartbeat_ms --dead_after_ms --kills=SPEC[,SPEC...]
//   SPEC = rank:incarnation:step:point, point one of
//     before  before the quorum of that step
//     mid     after that step's backward, before its gradient average (its peers' fails)
//     save    while sending the state to a joiner (after the tensors, before the optimizer)
//     load    while receiving the state (everything received, nothing of the archive applied)
//   The killing rank first writes <dir>/kill.<rank>.<incarnation> with the wall time (µs), and
//   <dir>/down.<rank>.<incarnation> (also written by a rank that fails).
// Before its last step a rank waits (up to 60 s) until every killed group's next incarnation is
// about to join (WaitForRestartedGroups), so that the run does not end before it is back; not
// with --no_wait. A restarted group that finds every other group gone (NothingToRejoin) exits 0.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <ATen/ops/mse_loss.h>
#include <ATen/ops/randn.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/torch_error.h"
#include "comm/registry.h"
#include "comm/store/file_store.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "ft/hsdp.h"
#include "ft/kill_worker_model.h"
#include "ft/membership.h"

namespace fairscale::ft {
namespace {

struct Kill {
  int rank = -1;
  int incarnation = 0;
  int64_t step = -1;
  std::string point;
};

struct Flags {
  std::string dir;
  int64_t steps = 20;
  int step_ms = 0;
  int heartbeat_ms = 100;
  int dead_after_ms = 1000;
  std::vector<Kill> kills;
  bool no_wait = false;  // do not wait for restarted groups before the last step
};

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  int out = fallback;
  if (v != nullptr && !absl::SimpleAtoi(v, &out)) {
    throw std::runtime_error(absl::StrCat("bad ", name, "=", v));
  }
  return out;
}

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::pair<std::string, std::string> kv = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    int64_t n = 0;
    const bool number = absl::SimpleAtoi(kv.second, &n);
    if (kv.first == "--dir") {
      f.dir = kv.second;
    } else if (kv.first == "--steps" && number) {
      f.steps = n;
    } else if (kv.first == "--step_ms" && number) {
      f.step_ms = static_cast<int>(n);
    } else if (kv.first == "--heartbeat_ms" && number) {
      f.heartbeat_ms = static_cast<int>(n);
    } else if (kv.first == "--dead_after_ms" && number) {
      f.dead_after_ms = static_cast<int>(n);
    } else if (kv.first == "--no_wait") {
      f.no_wait = true;
    } else if (kv.first == "--kills") {
      for (absl::string_view spec : absl::StrSplit(kv.second, ',', absl::SkipEmpty())) {
        std::vector<std::string> p = absl::StrSplit(spec, ':');
        Kill k;
        if (p.size() != 4 || !absl::SimpleAtoi(p[0], &k.rank) ||
            !absl::SimpleAtoi(p[1], &k.incarnation) || !absl::SimpleAtoi(p[2], &k.step)) {
          throw std::runtime_error(absl::StrCat("bad --kills entry '", spec, "'"));
        }
        k.point = p[3];
        f.kills.push_back(k);
      }
    } else {
      throw std::runtime_error(absl::StrCat("unknown or bad flag '", argv[i], "'"));
    }
  }
  if (f.dir.empty()) throw std::runtime_error("--dir is required");
  return f;
}

void WriteAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    if (!out.flush()) throw std::runtime_error(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    throw std::runtime_error(absl::StrCat("cannot rename ", tmp));
  }
}

bool Exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

// Before the last step: every group that went down (down.<rank>.<k>: killed, or failed, e.g. a
// joiner whose source died in the transfer) must be back (ready.<r>.<k + 1> of each of its
// ranks, written right before their first quorum), so that the run does not end before a
// restarted group rejoins. Then a moment for their arrival to be posted. At most 60 s.
void WaitForRestartedGroups(const std::string& dir, int group_size) {
  const absl::Time until = absl::Now() + absl::Seconds(60);
  bool waited = false;
  for (;;) {
    bool missing = false;
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) return;
    while (dirent* e = readdir(d)) {
      int rank = 0;
      int k = 0;
      const std::vector<std::string> p = absl::StrSplit(e->d_name, '.');
      if (p.size() != 3 || p[0] != "down" || !absl::SimpleAtoi(p[1], &rank) ||
          !absl::SimpleAtoi(p[2], &k)) {
        continue;
      }
      for (int r = rank / group_size * group_size; r < (rank / group_size + 1) * group_size; ++r) {
        missing = missing || !Exists(absl::StrCat(dir, "/ready.", r, ".", k + 1));
      }
    }
    closedir(d);
    if (!missing || absl::Now() >= until) break;
    waited = true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  if (waited) absl::SleepFor(absl::Milliseconds(500));
}

// Where main() marks this incarnation down when it fails ("" until known).
std::string g_down_marker;

int Run(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  const int rank = EnvInt("RANK", -1);
  const int world = EnvInt("WORLD_SIZE", -1);
  const int group_size = EnvInt("FS_REPLICA_GROUP_SIZE", -1);
  const int incarnation = EnvInt("FS_RESTART_COUNT", 0);
  if (rank < 0 || world < 1 || group_size < 1 || world % group_size != 0) {
    throw std::runtime_error("needs RANK, WORLD_SIZE and FS_REPLICA_GROUP_SIZE (fs_launch "
                             "--replica_group_size)");
  }
  const int g = rank / group_size;
  const int s = rank % group_size;
  g_down_marker = absl::StrCat(flags.dir, "/down.", rank, ".", incarnation);
  auto kill_here = [&](int64_t step, const std::string& point) {
    for (const Kill& k : flags.kills) {
      if (k.rank == rank && k.incarnation == incarnation && k.point == point &&
          (k.step == step || point == "save" || point == "load")) {
        WriteAtomically(absl::StrCat(flags.dir, "/kill.", rank, ".", incarnation),
                        absl::StrCat(absl::ToUnixMicros(absl::Now())));
        WriteAtomically(absl::StrCat(flags.dir, "/down.", rank, ".", incarnation), "");
        raise(SIGKILL);
      }
    }
  };

  std::shared_ptr<comm::Store> store =
      base::ValueOrThrow(comm::FileStore::Create(flags.dir + "/store"), "the FileStore");
  comm::CommConfig group_config;
  group_config.store = store;
  group_config.rank = s;
  group_config.size = group_size;
  group_config.timeout = absl::Seconds(10);
  group_config.name = absl::StrCat("kill/g", g, "/i", incarnation);
  std::shared_ptr<comm::Communicator> group_comm = base::ValueOrThrow(
      comm::CreateCommunicator("tcp", group_config), "the group communicator");

  Membership::Options mo;
  mo.group = g;
  mo.shard = s;
  mo.num_groups = world / group_size;
  mo.group_size = group_size;
  mo.heartbeat_interval = absl::Milliseconds(flags.heartbeat_ms);
  mo.dead_after = absl::Milliseconds(flags.dead_after_ms);
  mo.poll_interval = absl::Milliseconds(10);
  mo.below_min_wait = absl::Seconds(1);
  std::unique_ptr<Membership> m = base::ValueOrThrow(Membership::Create(store, mo), "membership");

  // Each group's generator starts elsewhere: after a transfer the joiner's must equal its
  // source's (the test compares the draws).
  torch::manual_seed(1000 + g);
  fsdp::FullyShardedDataParallel model(
      testing::MakeKillNet(), group_comm, fsdp::FsdpOptions().sharding_strategy(fsdp::ShardingStrategy::kFullShard));
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(testing::kKillLr));
  comm::CommConfig base_config;
  base_config.store = store;
  base_config.timeout = absl::Seconds(10);
  base_config.name = "kill/";
  FaultTolerantHsdp hsdp(model, opt, *m,
                         HsdpOptions().backend("tcp").comm_config(base_config)
                             .quorum_timeout(absl::Seconds(60)).commit_timeout(absl::Seconds(60))
                             .collective_timeout(absl::Seconds(5)));
  int64_t rows = 0;
  hsdp.add_state(
      "rows",
      [&] {
        kill_here(-1, "save");
        return std::to_string(rows);
      },
      [&](const std::string& bytes) {
        kill_here(-1, "load");
        rows = std::stoll(bytes);
      });

  nlohmann::json attempts = nlohmann::json::array();
  size_t recorded = 0;
  bool ready_written = false;
  while (hsdp.step() < flags.steps) {
    const int64_t step = hsdp.step();
    if (step == flags.steps - 1 && !flags.no_wait) WaitForRestartedGroups(flags.dir, group_size);
    kill_here(step, "before");
    if (!ready_written) {
      WriteAtomically(absl::StrCat(flags.dir, "/ready.", rank, ".", incarnation), "");
      ready_written = true;
    }
    hsdp.begin_step();
    opt.zero_grad();
    auto [x, y] = testing::KillBatch(hsdp.step(), g, s);
    at::mse_loss(model(x), y).backward();
    kill_here(hsdp.step(), "mid");
    if (flags.step_ms > 0) absl::SleepFor(absl::Milliseconds(flags.step_ms));
    const bool committed = hsdp.end_step();
    if (committed) rows += x.size(0);
    const double draw = committed ? at::randn({1}, at::kDouble).item<double>() : 0.0;
    for (; recorded < hsdp.history().size(); ++recorded) {
      const HsdpStepRecord& r = hsdp.history()[recorded];
      attempts.push_back({{"step", r.step},
                          {"epoch", r.epoch},
                          {"groups", r.groups},
                          {"committed", r.committed},
                          {"received_state", r.received_state},
                          {"source_group", r.source_group},
                          {"error", r.error},
                          {"draw", r.committed ? draw : 0.0},
                          {"at_us", absl::ToUnixMicros(absl::Now())}});
    }
  }
  nlohmann::json params = nlohmann::json::array();
  {
    auto guard = model->summon_full_params(/*writeback=*/false);
    for (const at::Tensor& p : model->module()->parameters()) {
      at::Tensor flat = p.detach().reshape({-1}).contiguous();
      params.push_back(std::vector<double>(flat.data_ptr<double>(),
                                           flat.data_ptr<double>() + flat.numel()));
    }
  }
  nlohmann::json result = {{"rank", rank},       {"group", g},
                           {"incarnation", incarnation}, {"pid", getpid()},
                           {"rows", rows},       {"attempts", attempts},
                           {"params", params}};
  WriteAtomically(absl::StrCat(flags.dir, "/result.", rank, ".json"), result.dump());
  m->Leave();
  return 0;
}

}  // namespace
}  // namespace fairscale::ft

int main(int argc, char** argv) {
  try {
    return fairscale::ft::Run(argc, argv);
  } catch (const fairscale::ft::NothingToRejoin& e) {
    std::printf("kill_worker: %s: exiting 0\n", e.what_without_backtrace());
    std::fflush(stdout);
    _exit(0);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "kill_worker: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kill_worker: %s\n", e.what());
  }
  std::fflush(stderr);
  if (!fairscale::ft::g_down_marker.empty()) {
    const int fd = open(fairscale::ft::g_down_marker.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) close(fd);
  }
  _exit(3);  // no destructors: a dead peer must not make teardown wait
}
