// A skip connection's identity (//pipe:skip_id, part of //pipe's API through skip.h): its
// Namespace and name. Kept apart from skip.h (which needs torch::nn) so that the codec of the
// skip declarations ranks exchange (internal/skip_declarations.h) and its fuzz target link c10
// only.
#pragma once

#include <string>

namespace fairscale::pipe {

// Isolates skip names (FairScale's Namespace). Unlike FairScale's (a unique object per
// instance), a namespace is identified by its name, so that ranks that build their layers
// separately (Pipe::CreateForStage) agree on it. Namespace() is the default namespace of every
// name that is not isolated.
class Namespace {
 public:
  Namespace() = default;
  // A non-empty name (c10::Error otherwise).
  explicit Namespace(std::string name);
  const std::string& name() const { return name_; }
  bool is_default() const { return name_.empty(); }
  bool operator==(const Namespace& o) const { return name_ == o.name_; }
  bool operator!=(const Namespace& o) const { return name_ != o.name_; }
  bool operator<(const Namespace& o) const { return name_ < o.name_; }

 private:
  std::string name_;
};

// A skip tensor's identity: its name in its namespace.
struct SkipId {
  Namespace ns;
  std::string name;
  bool operator==(const SkipId& o) const { return ns == o.ns && name == o.name; }
  bool operator<(const SkipId& o) const {
    return ns < o.ns || (ns == o.ns && name < o.name);
  }
};
// "'name'", or "'name' (namespace 'ns')" outside the default namespace.
std::string DescribeSkip(const SkipId& id);

}  // namespace fairscale::pipe
