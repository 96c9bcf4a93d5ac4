#include "examples/gpt/data.h"

#include <algorithm>
#include <stdexcept>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

// Generated from examples/data/kjv_genesis_exodus.txt by the :corpus_cc genrule.
extern const char kFsGptCorpus[];
extern const unsigned long kFsGptCorpusSize;

namespace fairscale::examples::gpt {

absl::string_view Corpus() { return absl::string_view(kFsGptCorpus, kFsGptCorpusSize); }

CharTokenizer::CharTokenizer(absl::string_view text) {
  bool seen[256] = {};
  for (unsigned char c : text) seen[c] = true;
  for (int c = 0; c < 256; ++c) {
    id_of_[c] = -1;
    if (seen[c]) {
      id_of_[c] = static_cast<int16_t>(chars_.size());
      chars_.push_back(static_cast<char>(c));
    }
  }
}

absl::StatusOr<std::vector<int64_t>> CharTokenizer::Encode(absl::string_view text) const {
  std::vector<int64_t> ids;
  ids.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const int id = id_of_[static_cast<unsigned char>(text[i])];
    if (id < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("CharTokenizer: byte 0x", absl::Hex(static_cast<unsigned char>(text[i])),
                       " at offset ", i, " is not in the vocabulary (", chars_.size(),
                       " characters)"));
    }
    ids.push_back(id);
  }
  return ids;
}

std::string CharTokenizer::Decode(const std::vector<int64_t>& ids) const {
  std::string s;
  s.reserve(ids.size());
  for (int64_t id : ids) s.push_back(id >= 0 && id < vocab_size() ? chars_[id] : '?');
  return s;
}

TokenData::TokenData(const CharTokenizer& tokenizer, absl::string_view text, double val_fraction) {
  absl::StatusOr<std::vector<int64_t>> ids = tokenizer.Encode(text);
  if (!ids.ok()) throw std::invalid_argument(std::string(ids.status().message()));
  const size_t val = static_cast<size_t>(static_cast<double>(ids->size()) * val_fraction);
  train_.assign(ids->begin(), ids->end() - val);
  val_.assign(ids->end() - val, ids->end());
}

namespace {
uint64_t Mix(uint64_t z) {  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
}  // namespace

std::vector<int64_t> TokenData::Batch(uint64_t seed, int64_t step, int rank, Split split,
                                      int64_t batch, int64_t seq) const {
  const std::vector<int64_t>& src = tokens(split);
  if (static_cast<int64_t>(src.size()) < seq + 1) {
    throw std::invalid_argument(absl::StrCat("TokenData::Batch: the ",
                                             split == Split::kTrain ? "train" : "val",
                                             " split has ", src.size(), " tokens, need ", seq + 1));
  }
  const uint64_t starts = src.size() - static_cast<uint64_t>(seq);  // windows that fit
  std::vector<int64_t> out;
  out.reserve(batch * (seq + 1));
  uint64_t key = Mix(seed + 0x9e3779b97f4a7c15ULL);
  key = Mix(key ^ static_cast<uint64_t>(step));
  key = Mix(key ^ (static_cast<uint64_t>(rank) << 1 | (split == Split::kVal ? 1 : 0)));
  for (int64_t row = 0; row < batch; ++row) {
    const uint64_t start = Mix(key + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(row + 1)) % starts;
    out.insert(out.end(), src.begin() + start, src.begin() + start + seq + 1);
  }
  return out;
}

}  // namespace fairscale::examples::gpt
