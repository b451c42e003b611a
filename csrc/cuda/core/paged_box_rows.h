// The height of the TMA boxes in which the Hopper forward reads paged keys
// in place (FwdSm90Tma in tma_loads_sm90.h), and so whether it reads them by
// boxes at all (plan_fwd's FwdPlan::keys). Plain C++: the plan, compiled
// into CPU-only builds too, asks the same rule as the kernel's host side.
#pragma once

namespace flash {

// The largest power of two dividing both the page and the key tile, up to
// 256 rows (TMA's box limit), so that no box crosses a page or a tile. A
// box must be at least 8 rows (one swizzle atom high) to land on whole
// swizzle atoms of a stage; pages that give less are gathered row by row.
inline int paged_tma_box_rows(int page_size, int block_n) {
  int rows = 1;
  while (rows < 256 && page_size % (2 * rows) == 0 && block_n % (2 * rows) == 0) rows *= 2;
  return rows;
}
constexpr int kPagedTmaMinBoxRows = 8;

// The smallest box by which plan_fwd has the producer read paged keys
// (FwdPlan::keys); pages that give smaller boxes are gathered row by row.
// On the H200 (d128, causal paged prefill, PERF_LOG 2026-11-29 "paged keys
// measured") the gather cost 1.26-1.37x the contiguous time at every page
// size from 1 to 32 rows, and boxes 1.16-1.18x at 64 rows but 1.42-1.51x at
// 16 and 1.98-2.12x at 8.
constexpr int kPagedBoxesMinRows = 64;

}  // namespace flash
