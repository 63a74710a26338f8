// PeerLinks: one device's links to the server's other devices — which peers there are (targets of
// peer eviction), which components of the pipelines homed here run on which peer (split layouts,
// components moved or evicted to a peer), and which pipelines homed on a peer have components
// hosted here (kept alive while they are). Bookkeeping only: the moves themselves are calls
// between the devices' workers (DeviceRuntime).
//
// Thread-safety: thread-safe. Changed on the owning device's worker; read from any thread (request
// validation, descriptions, the runner of a split pipeline).
#ifndef STOWAGE_RUNTIME_PEER_LINKS_H_
#define STOWAGE_RUNTIME_PEER_LINKS_H_

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "models/pipelines/component.h"
#include "models/pipelines/pipeline.h"

namespace stowage {

class DeviceRuntime;

class PeerLinks {
 public:
  using RemoteMap = std::map<const Component*, DeviceRuntime*>;

  // The other devices; set once (DeviceSet), before any pipeline names them.
  void SetPeers(std::vector<DeviceRuntime*> peers);
  std::vector<DeviceRuntime*> peers() const;
  // The peer named `device`, or null.
  DeviceRuntime* PeerNamed(const std::string& device) const;

  // The peer that runs `component` of pipeline `pipeline` (homed here), or null when it runs here.
  DeviceRuntime* PeerFor(const std::string& pipeline, const Component* component) const;
  // Every component of `pipeline` that runs on a peer, and the peer.
  RemoteMap RemoteOf(const std::string& pipeline) const;
  // True when some component of `pipeline` runs on a peer (per request: no copy of the map).
  bool HasRemote(const std::string& pipeline) const;
  // The distinct peers of RemoteOf(pipeline).
  std::set<DeviceRuntime*> PeersOf(const std::string& pipeline) const;
  // Replaces `pipeline`'s remote components (an empty map: all run here).
  void SetRemote(const std::string& pipeline, RemoteMap remote);
  // `component` of `pipeline` runs on `peer` from now on (null: here).
  void SetRemoteComponent(const std::string& pipeline, const Component* component, DeviceRuntime* peer);

  // A pipeline homed on a peer has a component here: it lives as long as the entry.
  void AddGuest(const std::string& pipeline, std::shared_ptr<Pipeline> hosted);
  // Removes the entry and returns the pipeline (null when none), for the caller to release outside
  // any lock.
  std::shared_ptr<Pipeline> TakeGuest(const std::string& pipeline);
  std::vector<std::string> GuestNames() const;

 private:
  mutable absl::Mutex mu_;
  std::vector<DeviceRuntime*> peers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, RemoteMap> remote_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<Pipeline>> guests_ ABSL_GUARDED_BY(mu_);
};

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_PEER_LINKS_H_
