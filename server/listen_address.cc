#include "server/listen_address.h"

namespace stowage {

std::optional<HostPort> SplitHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return std::nullopt;
  HostPort out{address.substr(0, colon), address.substr(colon + 1)};
  if (out.host.size() >= 2 && out.host.front() == '[' && out.host.back() == ']') {
    out.host = out.host.substr(1, out.host.size() - 2);
  }
  return out;
}

std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

int ResolveForListening(const HostPort& address, addrinfo** found) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  *found = nullptr;
  return ::getaddrinfo(address.host.empty() ? nullptr : address.host.c_str(), address.port.c_str(), &hints, found);
}

}  // namespace stowage
