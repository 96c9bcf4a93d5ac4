// The range math of FSDP's flat parameters (//fsdp, internal), written once: how a flat
// parameter of `numel` elements is padded and split over `world` ranks, and which parts of the
// original parameters laid out in it fall into a range of it. The training path
// (collect_and_shard), the full state dict, the sharded checkpoint and the optimizer state all
// use these functions.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

namespace fairscale::fsdp::internal {

// Elements per rank of a flat parameter of `numel` elements sharded over `world` ranks; the
// padded flat parameter has world * ShardNumel elements (zeros at the end).
inline int64_t ShardNumel(int64_t numel, int world) { return (numel + world - 1) / world; }

// The unpadded part [begin, end) of a flat parameter of `numel` elements that rank `rank` of
// `world` holds (empty when the rank holds only padding).
inline std::pair<int64_t, int64_t> OwnedRange(int64_t numel, int rank, int world) {
  const int64_t shard = ShardNumel(numel, world);
  const int64_t begin = std::min(numel, rank * shard);
  return {begin, std::min(numel, begin + shard)};
}

// Calls fn(index, entry_begin, flat_begin, length) for every entry of `entries` (anything with
// `offset` and `numel` members, laid out in a flat parameter at [offset, offset + numel)) that
// overlaps the flat range [begin, end): `length` elements starting at `entry_begin` in the entry
// (flattened) and at `flat_begin` in the flat parameter.
template <typename Entries, typename Fn>
void ForEachOverlap(const Entries& entries, int64_t begin, int64_t end, Fn fn) {
  for (size_t i = 0; i < entries.size(); ++i) {
    const int64_t lo = std::max(begin, entries[i].offset);
    const int64_t hi = std::min(end, entries[i].offset + entries[i].numel);
    if (lo < hi) fn(i, lo - entries[i].offset, lo, hi - lo);
  }
}

// The per-parameter (dim-0) layout (FsdpOptions::flatten_parameters(false)): a parameter of
// `rows` rows of `row_numel` elements keeps ShardNumel(rows, world) rows per rank, so rank q
// holds its flattened elements [q * rank_numel, min(numel, (q + 1) * rank_numel)).
inline int64_t Dim0RankNumel(int64_t rows, int64_t row_numel, int world) {
  return ShardNumel(rows, world) * row_numel;
}

// Calls fn(rank, entry_begin, length) for the part of a dim-0-sharded parameter of `numel`
// elements that each of `world` ranks holds (ranks holding only padding are skipped).
template <typename Fn>
void ForEachDim0Piece(int64_t numel, int64_t rank_numel, int world, Fn fn) {
  for (int q = 0; q < world; ++q) {
    const int64_t begin = std::min(numel, q * rank_numel);
    const int64_t end = std::min(numel, begin + rank_numel);
    if (begin < end) fn(q, begin, end - begin);
  }
}

}  // namespace fairscale::fsdp::internal
