// Skip connections (//pipe): FairScale's @skippable, stash / pop, Namespace and verify_skippables
// for LibTorch. A layer of a torch::nn::Sequential stashes a tensor under a name and a later layer
// pops it, e.g. a U-Net's encoder output added back in the decoder. The model runs the same way
// unpipelined (Sequential::forward) and in a Pipe, which carries each skip tensor from the stage
// that stashes it to the stage that pops it, and its gradient back (see README.md, "Skip
// connections").
//
//   struct EncoderImpl : torch::nn::Module, pipe::Skippable {
//     EncoderImpl() : Skippable(pipe::SkippableOptions().stash({"1to3"})) { ... }
//     at::Tensor forward(at::Tensor x) {
//       stash("1to3", x);               // FairScale: yield stash('1to3', x)
//       return f(x);
//     }
//   };
//   struct DecoderImpl : torch::nn::Module, pipe::Skippable {
//     DecoderImpl() : Skippable(pipe::SkippableOptions().pop({"1to3"})) { ... }
//     at::Tensor forward(at::Tensor x) {
//       return g(x) + pop("1to3");      // FairScale: skip = yield pop('1to3')
//     }
//   };
//   torch::nn::Sequential model(Encoder(), Middle(), Decoder());
//   pipe::verify_skippables(model);     // Pipe::Create checks the same, on every rank
//
// Every declared name must be stashed by exactly one layer and popped by exactly one later layer
// (in its namespace: Skippable::isolate lets two pairs share a name). Errors raise c10::Error
// with FairScale's wording ("'1to3' has not been declared as stashable", "one or more pairs of
// stash and pop do not match: ...").
//
// Where stashed tensors wait: in the calling thread's current SkipTracker. Without a pipe that
// is a thread-local default tracker that keeps a tensor until it is popped (as FairScale's);
// SkipTrackerScope installs another one for a scope (e.g. to isolate runs). A Pipe's stage runs
// its layers on a tracker of its own per micro-batch.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstddef>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "pipe/skip_id.h"

namespace fairscale::pipe {

class StageImpl;

// The names a Skippable layer stashes and pops (FairScale's @skippable(stash=..., pop=...)).
struct SkippableOptions {
  TORCH_ARG(std::vector<std::string>, stash) = {};
  TORCH_ARG(std::vector<std::string>, pop) = {};
};

// Mix-in for a layer with skip connections: derive your module from torch::nn::Module and
// Skippable, declare its names in the constructor, and call stash() / pop() in forward(). The
// pipe finds Skippable layers among the Sequential's direct children (dynamic_cast).
class Skippable {
 public:
  // Names must be non-empty (c10::Error otherwise); repeats are merged.
  explicit Skippable(SkippableOptions options);
  virtual ~Skippable() = default;

  // Puts every declared name (or just `only`, each of which must be declared) into namespace
  // `ns`, so that another pair of layers may use the same names. Returns *this. Call it before
  // the model is used (Pipe::Create reads the namespaces once).
  Skippable& isolate(const Namespace& ns);
  Skippable& isolate(const Namespace& ns, const std::vector<std::string>& only);

  const std::set<std::string>& stashable_names() const { return stashable_; }
  const std::set<std::string>& poppable_names() const { return poppable_; }
  // The namespace of declared name `name` (the default one unless isolated).
  Namespace namespace_of(const std::string& name) const;
  // Namespaced ids of the declared names, in name order.
  std::vector<SkipId> stashable() const;
  std::vector<SkipId> poppable() const;

  // In forward(): hands `tensor` (defined) to the layer that pops `name`. Raises c10::Error if
  // `name` is not declared stashable.
  void stash(const std::string& name, at::Tensor tensor);
  // In forward(): the tensor stashed under `name` (removed from the tracker). Raises c10::Error
  // if `name` is not declared poppable or nothing is stashed under it.
  at::Tensor pop(const std::string& name);

 private:
  std::set<std::string> stashable_;
  std::set<std::string> poppable_;
  std::map<std::string, Namespace> namespaces_;
};

// Holds stashed tensors until they are popped (FairScale's SkipTracker). Not thread-safe: one
// per thread (current_skip_tracker) or per stage forward.
class SkipTracker {
 public:
  SkipTracker() = default;
  SkipTracker(const SkipTracker&) = delete;
  SkipTracker& operator=(const SkipTracker&) = delete;

  // Keeps `tensor` under `id`, replacing what was there.
  void save(const SkipId& id, at::Tensor tensor);
  // Takes the tensor saved under `id` out; c10::Error "'name' has not been stashed" if none.
  at::Tensor load(const SkipId& id);
  bool contains(const SkipId& id) const { return tensors_.count(id) > 0; }
  // Tensors stashed and not popped yet.
  size_t size() const { return tensors_.size(); }
  std::vector<SkipId> ids() const;
  void clear() { tensors_.clear(); }

 private:
  friend class Skippable;
  friend class StageImpl;
  // Per-layer checks, used by the pipe's stages around each Skippable layer's forward: what a
  // layer must stash and pop (FairScale's "must be stashed / popped but have not").
  struct LayerCall {
    const Skippable* layer = nullptr;
    std::string name;  // the layer's name in its Sequential, for messages
    std::set<std::string> stashed;
    std::set<std::string> popped;
  };
  void BeginLayer(const Skippable& layer, const std::string& name);
  void EndLayer();
  // "layer '3': " while `layer`'s forward runs in a stage, "" otherwise.
  std::string Where(const Skippable* layer) const;

  std::map<SkipId, at::Tensor> tensors_;
  std::optional<LayerCall> call_;
};

// The calling thread's tracker: the innermost SkipTrackerScope's, else a thread-local default.
SkipTracker& current_skip_tracker();

// Makes a tracker the thread's current one until the scope ends (then the previous one is
// current again). The default constructor installs a fresh tracker of its own.
class SkipTrackerScope {
 public:
  SkipTrackerScope();
  explicit SkipTrackerScope(SkipTracker* tracker);
  ~SkipTrackerScope();
  SkipTrackerScope(const SkipTrackerScope&) = delete;
  SkipTrackerScope& operator=(const SkipTrackerScope&) = delete;
  SkipTracker& tracker() { return *tracker_; }

 private:
  std::optional<SkipTracker> own_;
  SkipTracker* tracker_;
  SkipTracker* previous_;
};

// FairScale's verify_skippables: every skip name (per namespace) is stashed by exactly one
// Skippable child of `model` and popped by exactly one later one. Raises c10::Error
// "pipe::verify_skippables: INVALID_ARGUMENT: one or more pairs of stash and pop do not match:
// ..." listing every problem: a layer declaring a name both stashable and poppable, a name
// redeclared as stashable / poppable without a namespace, a pop before (or without) its stash,
// a stash nobody pops.
void verify_skippables(const torch::nn::Sequential& model);

}  // namespace fairscale::pipe
