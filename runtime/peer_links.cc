#include "runtime/peer_links.h"

#include <utility>

#include "runtime/device_runtime.h"

namespace stowage {

void PeerLinks::SetPeers(std::vector<DeviceRuntime*> peers) {
  absl::MutexLock lock(&mu_);
  peers_ = std::move(peers);
}

std::vector<DeviceRuntime*> PeerLinks::peers() const {
  absl::MutexLock lock(&mu_);
  return peers_;
}

DeviceRuntime* PeerLinks::PeerNamed(const std::string& device) const {
  absl::MutexLock lock(&mu_);
  for (DeviceRuntime* p : peers_) {
    if (p->device_name() == device) return p;
  }
  return nullptr;
}

DeviceRuntime* PeerLinks::PeerFor(const std::string& pipeline, const Component* component) const {
  absl::MutexLock lock(&mu_);
  auto it = remote_.find(pipeline);
  if (it == remote_.end()) return nullptr;
  auto found = it->second.find(component);
  return found == it->second.end() ? nullptr : found->second;
}

PeerLinks::RemoteMap PeerLinks::RemoteOf(const std::string& pipeline) const {
  absl::MutexLock lock(&mu_);
  auto it = remote_.find(pipeline);
  return it == remote_.end() ? RemoteMap{} : it->second;
}

bool PeerLinks::HasRemote(const std::string& pipeline) const {
  absl::MutexLock lock(&mu_);
  return remote_.count(pipeline) > 0;  // SetRemote / SetRemoteComponent keep no empty map.
}

std::set<DeviceRuntime*> PeerLinks::PeersOf(const std::string& pipeline) const {
  std::set<DeviceRuntime*> peers;
  for (const auto& entry : RemoteOf(pipeline)) peers.insert(entry.second);
  return peers;
}

void PeerLinks::SetRemote(const std::string& pipeline, RemoteMap remote) {
  absl::MutexLock lock(&mu_);
  if (remote.empty()) {
    remote_.erase(pipeline);
  } else {
    remote_[pipeline] = std::move(remote);
  }
}

void PeerLinks::SetRemoteComponent(const std::string& pipeline, const Component* component, DeviceRuntime* peer) {
  absl::MutexLock lock(&mu_);
  RemoteMap& map = remote_[pipeline];
  if (peer == nullptr) {
    map.erase(component);
  } else {
    map[component] = peer;
  }
  if (map.empty()) remote_.erase(pipeline);
}

void PeerLinks::AddGuest(const std::string& pipeline, std::shared_ptr<Pipeline> hosted) {
  absl::MutexLock lock(&mu_);
  guests_[pipeline] = std::move(hosted);
}

std::shared_ptr<Pipeline> PeerLinks::TakeGuest(const std::string& pipeline) {
  absl::MutexLock lock(&mu_);
  auto it = guests_.find(pipeline);
  if (it == guests_.end()) return nullptr;
  std::shared_ptr<Pipeline> taken = std::move(it->second);
  guests_.erase(it);
  return taken;
}

std::vector<std::string> PeerLinks::GuestNames() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> names;
  for (const auto& entry : guests_) names.push_back(entry.first);
  return names;
}

}  // namespace stowage
