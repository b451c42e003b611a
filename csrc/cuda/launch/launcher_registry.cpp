#include "cuda/launch/launcher_registry.h"

#include <map>
#include <tuple>
#include <utility>

namespace flash {
namespace {

// Function-local static: registrations run from other translation units'
// static initialisers, whose order relative to this file is unspecified.
// (d_qk, d_v, is_bf16)
std::map<std::tuple<int, int, bool>, FwdLauncher>& fwd_table() {
  static std::map<std::tuple<int, int, bool>, FwdLauncher> table;
  return table;
}

// (d_qk, d_v, is_bf16)
std::map<std::tuple<int, int, bool>, BwdLauncher>& bwd_table() {
  static std::map<std::tuple<int, int, bool>, BwdLauncher> table;
  return table;
}

}  // namespace

FwdLauncher find_fwd_launcher(int compiled_head_dim, int compiled_head_dim_v, bool is_bf16) {
  const auto it = fwd_table().find({compiled_head_dim, compiled_head_dim_v, is_bf16});
  return it == fwd_table().end() ? nullptr : it->second;
}

FwdLauncherRegistration::FwdLauncherRegistration(int compiled_head_dim, int compiled_head_dim_v,
                                                 bool is_bf16, FwdLauncher launcher) {
  fwd_table()[{compiled_head_dim, compiled_head_dim_v, is_bf16}] = launcher;
}

BwdLauncher find_bwd_launcher(int compiled_head_dim, int compiled_head_dim_v, bool is_bf16) {
  const auto it = bwd_table().find({compiled_head_dim, compiled_head_dim_v, is_bf16});
  return it == bwd_table().end() ? nullptr : it->second;
}

BwdLauncherRegistration::BwdLauncherRegistration(int compiled_head_dim, int compiled_head_dim_v,
                                                 bool is_bf16, BwdLauncher launcher) {
  bwd_table()[{compiled_head_dim, compiled_head_dim_v, is_bf16}] = launcher;
}

namespace {

// (compiled head dim, q is bf16, the cache is e4m3)
std::map<std::tuple<int, bool, bool>, SplitKvLauncher>& splitkv_table() {
  static std::map<std::tuple<int, bool, bool>, SplitKvLauncher> table;
  return table;
}

}  // namespace

SplitKvLauncher find_splitkv_launcher(int compiled_head_dim, bool is_bf16, bool fp8_cache) {
  const auto it = splitkv_table().find({compiled_head_dim, is_bf16, fp8_cache});
  return it == splitkv_table().end() ? nullptr : it->second;
}

SplitKvLauncherRegistration::SplitKvLauncherRegistration(int compiled_head_dim, bool is_bf16,
                                                         SplitKvLauncher launcher, bool fp8_cache) {
  splitkv_table()[{compiled_head_dim, is_bf16, fp8_cache}] = launcher;
}

}  // namespace flash
