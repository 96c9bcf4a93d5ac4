// Writes the seeds of //pipe/fuzz:wire_fuzz_test (fuzz_input.h: control byte, then a boundary
// message's header and layout, or one rank's skip declarations) into the directory given as its
// argument. Every valid seed is a real encoding (EncodeHeader, EncodeLayout, EncodeDeclarations);
// a few hostile ones claim huge lengths, counts and sizes, or use non-canonical numbers.
//
//   ./bazelw run //pipe/fuzz:make_corpus -- "$PWD/pipe/fuzz/corpus"
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "pipe/fuzz/fuzz_input.h"
#include "pipe/internal/boundary_layout.h"
#include "pipe/internal/skip_declarations.h"

namespace {

namespace fz = fairscale::pipe::fuzz;
namespace pi = fairscale::pipe::internal;
using fairscale::pipe::Namespace;

std::string Words(const std::vector<int64_t>& words) {
  std::string out;
  for (int64_t w : words) {
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(static_cast<uint64_t>(w) >> (8 * i)));
  }
  return out;
}

void Put(const std::string& dir, const std::string& name, uint8_t control,
         const std::string& body) {
  std::ofstream out(dir + "/" + name, std::ios::binary | std::ios::trunc);
  out.put(static_cast<char>(control));
  out << body;
}

// A boundary message: the header of message `id` and the layout's words.
void PutLayout(const std::string& dir, const std::string& name, int64_t id,
               const pi::BoundaryLayout& layout, uint8_t extra = 0) {
  const std::vector<int64_t> words = pi::EncodeLayout(layout);
  const auto h = pi::EncodeHeader(id, static_cast<int64_t>(words.size()));
  Put(dir, name, fz::kModeBoundary | extra,
      Words(std::vector<int64_t>(h.begin(), h.end())) + Words(words));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_corpus OUT_DIR\n");
    return 2;
  }
  const std::string out = argv[1];
  using c10::ScalarType;

  // Layouts: a single tensor, lists of every wire dtype and rank 0-4, empty lists and sizes,
  // skip tensors after a single tensor and after a list.
  PutLayout(out, "layout_single_f32", 0, {false, 0, {{ScalarType::Float, true, {4, 8}}}});
  PutLayout(out, "layout_list_mixed", 7,
            {true, 0,
             {{ScalarType::Float, true, {3, 4}}, {ScalarType::Bool, false, {3}},
              {ScalarType::Long, false, {}}}});
  PutLayout(out, "layout_list_all_dtypes", 12,
            {true, 0,
             {{ScalarType::Double, true, {2}}, {ScalarType::Half, true, {2, 3}},
              {ScalarType::BFloat16, false, {1, 2, 3}}, {ScalarType::Char, false, {4, 1, 1, 2}},
              {ScalarType::Byte, false, {0}}, {ScalarType::Int, false, {5, 0, 7}},
              {ScalarType::Long, false, {1}}, {ScalarType::Bool, false, {2, 2}}}});
  PutLayout(out, "layout_empty_list", 1, {true, 0, {}});
  PutLayout(out, "layout_single_skips", 3,
            {false, 2,
             {{ScalarType::Float, true, {3, 4}}, {ScalarType::Float, true, {3, 6}},
              {ScalarType::Long, false, {3}}}});
  PutLayout(out, "layout_list_skip", 40,
            {true, 1,
             {{ScalarType::BFloat16, true, {8, 16, 32}}, {ScalarType::Half, false, {8}},
              {ScalarType::Float, true, {8, 16}}}});
  PutLayout(out, "layout_other_id", 5, {false, 0, {{ScalarType::Float, true, {2}}}},
            fz::kOtherId);
  {
    // A header that carries no layout (the layout did not change).
    const auto h = pi::EncodeHeader(9, 0);
    Put(out, "header_only", fz::kModeBoundary, Words({h.begin(), h.end()}));
  }
  // Hostile boundary messages: a header claiming 2^60 layout words, a layout claiming 2^60
  // tensors, 2^40 dimensions, sizes whose product overflows, a quantized dtype.
  Put(out, "hostile_header_len", fz::kModeBoundary,
      Words({pi::kHeaderMagic, 0, int64_t{1} << 60}));
  Put(out, "hostile_layout_count", fz::kModeBoundary,
      Words({pi::kHeaderMagic, 0, 4, 2, 1, int64_t{1} << 60, 0}));
  Put(out, "hostile_layout_ndim", fz::kModeBoundary,
      Words({pi::kHeaderMagic, 0, 7, 2, 0, 1, 0, 6, 1, int64_t{1} << 40}));
  Put(out, "hostile_layout_numel", fz::kModeBoundary,
      Words({pi::kHeaderMagic, 0, 10, 2, 0, 1, 0, 6, 1, 3, int64_t{1} << 32,
             int64_t{1} << 32, 4}));
  Put(out, "hostile_layout_dtype", fz::kModeBoundary,
      Words({pi::kHeaderMagic, 0, 8, 2, 0, 1, 0, static_cast<int64_t>(ScalarType::QInt8), 0, 1, 4}));

  // Skip declarations: what one rank contributes (its chunks' Skippable layers).
  const auto id = [](const std::string& ns, const std::string& name) {
    return fairscale::pipe::SkipId{ns.empty() ? Namespace() : Namespace(ns), name};
  };
  Put(out, "decl_empty", fz::kModeDeclarations, pi::EncodeDeclarations({}));
  Put(out, "decl_pair", fz::kModeDeclarations,
      pi::EncodeDeclarations({{0, 0, "0", {id("", "1to3")}, {}}, {0, 2, "2", {}, {id("", "1to3")}}}));
  Put(out, "decl_namespaces", fz::kModeDeclarations,
      pi::EncodeDeclarations({{0, 1, "encoder", {id("ns1", "skip"), id("ns2", "skip")}, {}},
                              {1, 0, "middle", {id("", "a")}, {id("ns1", "skip")}},
                              {3, 4, "decoder", {}, {id("", "a"), id("ns2", "skip")}}}));
  Put(out, "decl_interleaved", fz::kModeDeclarations,
      pi::EncodeDeclarations({{2, 0, "3", {id("u", "x"), id("u", "y")}, {}},
                              {6, 1, "10", {}, {id("u", "x")}},
                              {10, 0, "14", {id("", "z")}, {id("u", "y")}},
                              {11, 12, "layer with a long name: and colons", {}, {id("", "z")}}}));
  // Hostile declarations: a 20-digit length, signs, spaces, leading zeros, a count of 2^62.
  Put(out, "decl_hostile_len", fz::kModeDeclarations, "99999999999999999999:x");
  Put(out, "decl_hostile_sign", fz::kModeDeclarations, "+1:01:0 1:x1:01:0");
  Put(out, "decl_hostile_zero", fz::kModeDeclarations, "01:01:01:x1:01:0");
  Put(out, "decl_hostile_count", fz::kModeDeclarations, "1:01:01:x19:46116860184273879041:x");
  return 0;
}
