// The "host:port" listen addresses of the fronts (grpc_address, http_address, metrics_address):
// how they split, resolve, and read back. One place for the rule both fronts use.
#ifndef STOWAGE_SERVER_LISTEN_ADDRESS_H_
#define STOWAGE_SERVER_LISTEN_ADDRESS_H_

#include <netdb.h>

#include <optional>
#include <string>

namespace stowage {

struct HostPort {
  std::string host;  // Without the brackets of "[v6]"; empty: every address.
  std::string port;  // As written (may be empty or not a number: the caller checks).
};

// "host:port" or "[v6]:port" at the last ':'; nullopt when there is none.
std::optional<HostPort> SplitHostPort(const std::string& address);

// Everything before the last ':' (brackets kept), for reporting "host:<bound port>".
std::string HostOf(const std::string& address);

// getaddrinfo for a TCP socket to listen on `address` (AI_PASSIVE, numeric port); its error code
// (gai_strerror names it). On success the caller frees *found with freeaddrinfo.
int ResolveForListening(const HostPort& address, addrinfo** found);

}  // namespace stowage

#endif  // STOWAGE_SERVER_LISTEN_ADDRESS_H_
