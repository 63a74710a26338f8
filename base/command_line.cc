#include "base/command_line.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include "absl/flags/parse.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace stowage {
namespace {

// Set while absl parses: an exit during parsing is absl reporting bad usage or having printed help.
std::atomic<int> g_exit_status_while_parsing{-1};

void ExitWhileParsing() {
  const int status = g_exit_status_while_parsing.load();
  if (status < 0) return;
  std::cout.flush();  // _Exit flushes nothing: the help text and absl's error are in these buffers.
  std::cerr.flush();
  std::fflush(nullptr);
  std::_Exit(status);
}

bool IsHelpFlag(const char* arg) {
  for (const char* help : {"--help", "-help", "--helpfull", "-helpfull", "--helpshort", "-helpshort"}) {
    if (std::strcmp(arg, help) == 0) return true;
  }
  return false;
}

}  // namespace

std::vector<char*> ParseCommandLine(int argc, char** argv, const char* main_file) {
  static std::string file;
  file = main_file;
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view f) { return absl::EndsWith(f, file); };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  bool help = false;
  for (int i = 1; i < argc; ++i) help = help || IsHelpFlag(argv[i]);
  g_exit_status_while_parsing.store(help ? 0 : kBadUsageExitStatus);
  std::atexit(ExitWhileParsing);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  g_exit_status_while_parsing.store(-1);
  return args;
}

}  // namespace stowage
