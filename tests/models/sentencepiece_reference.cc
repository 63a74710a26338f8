#include "tests/models/sentencepiece_reference.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

namespace stowage {

std::string TrainSentencePiece(const std::string& args) {
  const auto status = sentencepiece::SentencePieceTrainer::Train(args);
  return status.ok() ? "" : status.ToString();
}

struct SentencePieceReference::Impl {
  sentencepiece::SentencePieceProcessor processor;
};

SentencePieceReference::SentencePieceReference() : impl_(std::make_unique<Impl>()) {}
SentencePieceReference::~SentencePieceReference() = default;

std::unique_ptr<SentencePieceReference> SentencePieceReference::Load(const std::string& model_path,
                                                                     std::string* error) {
  std::unique_ptr<SentencePieceReference> reference(new SentencePieceReference());
  const auto status = reference->impl_->processor.Load(model_path);
  if (!status.ok()) {
    *error = status.ToString();
    return nullptr;
  }
  return reference;
}

bool SentencePieceReference::Encode(const std::string& text, std::vector<int>* ids, std::string* error) const {
  const auto status = impl_->processor.Encode(text, ids);
  if (!status.ok()) *error = status.ToString();
  return status.ok();
}

int SentencePieceReference::unk_id() const { return impl_->processor.unk_id(); }
bool SentencePieceReference::is_byte(int id) const { return impl_->processor.IsByte(id); }
int SentencePieceReference::piece_size() const { return impl_->processor.GetPieceSize(); }

}  // namespace stowage
