// ParseCommandLine for the project's binaries: absl::ParseCommandLine with the exit statuses the
// README promises and a --help that lists the binary's own flags.
//
// absl::ParseCommandLine exits with status 1 on a malformed flag value (`--steps=abc`) or an
// unknown flag; here that is bad usage, status 2. `--help` (and --helpfull, --helpshort) print the
// flags defined in `main_file` (absl's default filter looks for files named after the binary and
// printed "No flags matched." for ours) and exit 0.
//
//   int main(int argc, char** argv) {
//     std::vector<char*> args = stowage::ParseCommandLine(argc, argv, "server/main.cc");
//     ...
//   }
#ifndef STOWAGE_BASE_COMMAND_LINE_H_
#define STOWAGE_BASE_COMMAND_LINE_H_

#include <vector>

namespace stowage {

inline constexpr int kBadUsageExitStatus = 2;

// Call once, first thing in main (it registers an atexit handler). Returns the positional
// arguments, argv[0] first.
std::vector<char*> ParseCommandLine(int argc, char** argv, const char* main_file);

}  // namespace stowage

#endif  // STOWAGE_BASE_COMMAND_LINE_H_
