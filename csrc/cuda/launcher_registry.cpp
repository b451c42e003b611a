#include "launcher_registry.h"

#include <map>
#include <utility>

namespace flash {
namespace {

// Function-local static: registrations run from other translation units'
// static initialisers, whose order relative to this file is unspecified.
std::map<std::pair<int, bool>, FwdLauncher>& fwd_table() {
  static std::map<std::pair<int, bool>, FwdLauncher> table;
  return table;
}

}  // namespace

FwdLauncher find_fwd_launcher(int compiled_head_dim, bool is_bf16) {
  const auto it = fwd_table().find({compiled_head_dim, is_bf16});
  return it == fwd_table().end() ? nullptr : it->second;
}

FwdLauncherRegistration::FwdLauncherRegistration(int compiled_head_dim, bool is_bf16,
                                                 FwdLauncher launcher) {
  fwd_table()[{compiled_head_dim, is_bf16}] = launcher;
}

}  // namespace flash
