// libsentencepiece behind a std-only interface, as the reference T5Tokenizer is tested against.
// sentencepiece_processor.h declares its own absl::string_view (std::string_view), which clashes
// with Abseil's: only sentencepiece_reference.cc includes it, and that file includes no Abseil.
#ifndef STOWAGE_TESTS_MODELS_SENTENCEPIECE_REFERENCE_H_
#define STOWAGE_TESTS_MODELS_SENTENCEPIECE_REFERENCE_H_

#include <memory>
#include <string>
#include <vector>

namespace stowage {

// SentencePieceTrainer::Train(args); "" on success, else the error.
std::string TrainSentencePiece(const std::string& args);

class SentencePieceReference {
 public:
  // nullptr (with *error set) when libsentencepiece cannot load `model_path`.
  static std::unique_ptr<SentencePieceReference> Load(const std::string& model_path, std::string* error);
  ~SentencePieceReference();

  // SentencePieceProcessor::Encode's ids; false (with *error set) when it fails.
  bool Encode(const std::string& text, std::vector<int>* ids, std::string* error) const;
  int unk_id() const;
  // Whether `id` is a byte-fallback piece (<0xXX>).
  bool is_byte(int id) const;
  int piece_size() const;

 private:
  SentencePieceReference();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace stowage

#endif  // STOWAGE_TESTS_MODELS_SENTENCEPIECE_REFERENCE_H_
