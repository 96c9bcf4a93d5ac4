// consolidate_checkpoint: turns a sharded FSDP checkpoint (fsdp/sharded_checkpoint.h) into files
// that plain LibTorch loads into the unwrapped module and its optimizer, offline (no ranks):
//
//   consolidate_checkpoint --checkpoint_dir=/ckpt/step_1000 --output=model.pt
//       [--optimizer_output=optim.pt]
//
//   Net net; torch::load(net, "model.pt");
//   torch::optim::Adam opt(net->parameters(), ...); torch::load(opt, "optim.pt");
//
// Every file is checked against the manifest's size and checksum; errors name the file and tensor
// and exit with status 1.
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "base/flags.h"
#include "fsdp/sharded_checkpoint.h"
#include "fsdp/state_dict.h"

ABSL_FLAG(std::string, checkpoint_dir, "", "directory of the sharded checkpoint (manifest.json)");
ABSL_FLAG(std::string, output, "", "where to write the full state dict (torch::load(module, path))");
ABSL_FLAG(std::string, optimizer_output, "",
          "where to write the optimizer state (torch::load(optimizer, path)); empty: skip");

int main(int argc, char** argv) {
  fairscale::base::ParseCommandLine(
      argc, argv,
      "turns a sharded FSDP checkpoint into a state dict file (and an\n"
      "optimizer file) that plain LibTorch loads into the unwrapped module, offline.\n"
      "\n"
      "  consolidate_checkpoint --checkpoint_dir=/ckpt/step_1000 --output=model.pt \\\n"
      "      [--optimizer_output=optim.pt]\n"
      "\n"
      "Environment read: none.");
  const std::string dir = absl::GetFlag(FLAGS_checkpoint_dir);
  const std::string output = absl::GetFlag(FLAGS_output);
  const std::string optimizer_output = absl::GetFlag(FLAGS_optimizer_output);
  if (dir.empty() || output.empty()) {
    std::fprintf(stderr, "consolidate_checkpoint: --checkpoint_dir and --output are required\n");
    return 2;
  }
  auto ckpt = fairscale::fsdp::consolidate_sharded_checkpoint(dir);
  if (!ckpt.ok()) {
    std::fprintf(stderr, "consolidate_checkpoint: %s\n", ckpt.status().ToString().c_str());
    return 1;
  }
  if (!optimizer_output.empty() && !ckpt->has_optimizer) {
    std::fprintf(stderr,
                 "consolidate_checkpoint: --optimizer_output: '%s' was saved without optimizer "
                 "state\n",
                 dir.c_str());
    return 1;
  }
  try {
    fairscale::fsdp::save_module_state_dict(ckpt->state_dict, output);
    if (!optimizer_output.empty()) {
      fairscale::fsdp::save_torch_optimizer(ckpt->optimizer, optimizer_output);
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "consolidate_checkpoint: %s\n", e.what_without_backtrace());
    return 1;
  }
  std::printf("consolidated %zu tensors saved at world size %d into %s%s%s\n",
              ckpt->state_dict.size(), ckpt->world_size, output.c_str(),
              optimizer_output.empty() ? "" : " and ", optimizer_output.c_str());
  return 0;
}
