// Data for the GPT job (//examples/gpt:data): the embedded corpus (the King James Version of
// Genesis and Exodus, public domain, see examples/data/SOURCE.md), a character-level tokenizer
// whose vocabulary is the corpus's set of bytes, and the batch function.
//
// A batch is a pure function of (seed, step, rank, split): resuming at any step needs no
// data-loader state, and every rank can compute any rank's batch. No LibTorch here; the trainer
// turns token vectors into tensors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fairscale::examples::gpt {

// The embedded corpus text (a few hundred KB, ASCII).
absl::string_view Corpus();

// Character (byte) level: id i is the i-th smallest distinct byte of the text it was built from.
class CharTokenizer {
 public:
  explicit CharTokenizer(absl::string_view text);
  int64_t vocab_size() const { return static_cast<int64_t>(chars_.size()); }
  // kInvalidArgument naming the first byte not in the vocabulary (and its offset).
  absl::StatusOr<std::vector<int64_t>> Encode(absl::string_view text) const;
  // Ids out of range decode as '?'.
  std::string Decode(const std::vector<int64_t>& ids) const;

 private:
  std::string chars_;  // id -> byte
  int16_t id_of_[256];  // byte -> id, -1 if absent
};

enum class Split { kTrain, kVal };

// The corpus as token ids, split into train (the first 1 - val_fraction) and val (the rest).
class TokenData {
 public:
  TokenData(const CharTokenizer& tokenizer, absl::string_view text, double val_fraction = 0.05);
  const std::vector<int64_t>& tokens(Split split) const {
    return split == Split::kTrain ? train_ : val_;
  }

  // `batch` windows of seq + 1 consecutive tokens, row-major [batch, seq + 1] (inputs are
  // columns 0..seq-1, targets 1..seq). The start of each window is drawn by a counter-based
  // generator from (seed, step, rank, split, row): the same arguments give the same batch.
  // Requires the split to hold at least seq + 1 tokens.
  std::vector<int64_t> Batch(uint64_t seed, int64_t step, int rank, Split split, int64_t batch,
                             int64_t seq) const;

 private:
  std::vector<int64_t> train_, val_;
};

}  // namespace fairscale::examples::gpt
