#include "runtime/hosted_pipelines.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/text.h"

namespace stowage {

const char* PipelineStateName(PipelineState state) {
  switch (state) {
    case PipelineState::kLoading:
      return "loading";
    case PipelineState::kReady:
      return "ready";
    case PipelineState::kUnloading:
      return "unloading";
    case PipelineState::kFailed:
      return "failed";
  }
  return "unknown";
}

HostedPipelines::Entry* HostedPipelines::Find(const std::string& name) {
  for (Entry& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

const HostedPipelines::Entry* HostedPipelines::Find(const std::string& name) const {
  for (const Entry& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

void HostedPipelines::Transition(const std::string& name, Target to, bool make_default) {
  Entry* e = Find(name);
  // Allowed edges (see the header's diagram).
  bool allowed = false;
  if (e == nullptr) {
    allowed = to == Target::kLoading;
  } else {
    switch (e->state) {
      case PipelineState::kLoading:
        allowed = to == Target::kReady || to == Target::kFailed || to == Target::kAbsent;
        break;
      case PipelineState::kReady:
        allowed = to == Target::kUnloading;
        break;
      case PipelineState::kUnloading:
        allowed = to == Target::kReady || to == Target::kAbsent;
        break;
      case PipelineState::kFailed:
        allowed = to == Target::kLoading || to == Target::kAbsent;
        break;
    }
  }
  if (!allowed) {
    std::cerr << "stowage: invalid pipeline lifecycle transition of '" << name << "' from "
              << (e == nullptr ? "absent" : PipelineStateName(e->state)) << std::endl;
    std::abort();
  }
  if (e == nullptr) {
    entries_.push_back(Entry{name, PipelineState::kLoading, "", nullptr});
    return;
  }
  const bool withdrawn_unload = e->state == PipelineState::kUnloading && to == Target::kReady;
  switch (to) {
    case Target::kLoading:
      e->state = PipelineState::kLoading;
      e->error.clear();
      break;
    case Target::kReady:
      e->state = PipelineState::kReady;
      if (make_default) displaced_default_.clear();
      if (default_.empty() || make_default || (withdrawn_unload && displaced_default_ == name)) default_ = name;
      if (withdrawn_unload && displaced_default_ == name) displaced_default_.clear();
      break;
    case Target::kFailed:
      e->state = PipelineState::kFailed;
      e->pipeline.reset();
      break;
    case Target::kUnloading:
      e->state = PipelineState::kUnloading;
      if (default_ == name) displaced_default_ = name;
      break;
    case Target::kAbsent:
      if (displaced_default_ == name) displaced_default_.clear();
      entries_.erase(entries_.begin() + (e - entries_.data()));
      break;
  }
  // The default invariant: a READY pipeline whenever one exists, else none.
  const Entry* current = default_.empty() ? nullptr : Find(default_);
  if (current == nullptr || current->state != PipelineState::kReady) {
    default_.clear();
    for (const Entry& other : entries_) {
      if (other.state == PipelineState::kReady) {
        default_ = other.name;
        break;
      }
    }
  }
}

absl::Status HostedPipelines::BeginLoad(const std::string& name) {
  absl::MutexLock lock(&mu_);
  if (const Entry* e = Find(name)) {
    switch (e->state) {
      case PipelineState::kLoading:
        return absl::AlreadyExistsError(absl::StrCat("pipeline '", name, "' is already being loaded"));
      case PipelineState::kReady:
        return absl::AlreadyExistsError(absl::StrCat("pipeline '", name, "' is already loaded"));
      case PipelineState::kUnloading:
        return absl::FailedPreconditionError(
            absl::StrCat("pipeline '", name, "' is being unloaded; load it again once it is gone"));
      case PipelineState::kFailed:
        break;  // A failed load may be retried.
    }
  }
  Transition(name, Target::kLoading);
  return absl::OkStatus();
}

void HostedPipelines::FinishLoad(const std::string& name, std::shared_ptr<Pipeline> pipeline,
                                 bool make_default) {
  absl::MutexLock lock(&mu_);
  Transition(name, Target::kReady, make_default);
  Find(name)->pipeline = std::move(pipeline);
}

void HostedPipelines::FailLoad(const std::string& name, const absl::Status& error) {
  absl::MutexLock lock(&mu_);
  Transition(name, Target::kFailed);
  Find(name)->error = error.ToString();
}

void HostedPipelines::AbandonLoad(const std::string& name) {
  absl::MutexLock lock(&mu_);
  Transition(name, Target::kAbsent);
}

absl::StatusOr<std::shared_ptr<Pipeline>> HostedPipelines::BeginUnload(const std::string& name) {
  absl::MutexLock lock(&mu_);
  Entry* e = Find(name);
  if (e == nullptr) {
    return absl::NotFoundError(absl::StrCat("pipeline '", Truncated(name), "' is not loaded"));
  }
  switch (e->state) {
    case PipelineState::kLoading:
      return absl::FailedPreconditionError(
          absl::StrCat("pipeline '", name, "' is still loading; unload it once its load has finished"));
    case PipelineState::kUnloading:
      return absl::FailedPreconditionError(absl::StrCat("pipeline '", name, "' is already being unloaded"));
    case PipelineState::kFailed:
      Transition(name, Target::kAbsent);
      return std::shared_ptr<Pipeline>();
    case PipelineState::kReady:
      break;
  }
  Transition(name, Target::kUnloading);
  return e->pipeline;
}

void HostedPipelines::FinishUnload(const std::string& name) {
  absl::MutexLock lock(&mu_);
  Transition(name, Target::kAbsent);
}

void HostedPipelines::AbandonUnload(const std::string& name) {
  absl::MutexLock lock(&mu_);
  Transition(name, Target::kReady);
}

absl::StatusOr<std::shared_ptr<Pipeline>> HostedPipelines::Resolve(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  if (name.empty()) {
    if (default_.empty()) return absl::UnavailableError("no pipeline is ready");
    return Find(default_)->pipeline;
  }
  const Entry* e = Find(name);
  if (e == nullptr) {
    std::vector<std::string> ready;
    for (const Entry& other : entries_) {
      if (other.state == PipelineState::kReady) ready.push_back(other.name);
    }
    return absl::NotFoundError(absl::StrCat("pipeline '", Truncated(name), "' not found; available: ",
                                            absl::StrJoin(ready, ", ")));
  }
  switch (e->state) {
    case PipelineState::kReady:
      return e->pipeline;
    case PipelineState::kLoading:
      return absl::UnavailableError(absl::StrCat("pipeline '", name, "' is still loading; retry shortly"));
    case PipelineState::kUnloading:
      return absl::FailedPreconditionError(absl::StrCat("pipeline '", name, "' is being unloaded"));
    case PipelineState::kFailed:
      return absl::FailedPreconditionError(absl::StrCat("pipeline '", name, "' failed to load: ", e->error));
  }
  return absl::InternalError("unknown pipeline state");
}

bool HostedPipelines::StillHosted(const std::string& name, const Pipeline* pipeline) const {
  absl::MutexLock lock(&mu_);
  const Entry* e = Find(name);
  return e != nullptr && e->pipeline.get() == pipeline &&
         (e->state == PipelineState::kReady || e->state == PipelineState::kUnloading);
}

std::vector<HostedPipelines::View> HostedPipelines::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<View> views;
  for (const Entry& e : entries_) {
    views.push_back(View{e.name, e.state, e.name == default_, e.error, e.pipeline});
  }
  return views;
}

}  // namespace stowage
