// A counter in global memory that orders work across thread blocks: a block
// waits until the counter reaches its turn, does its work, and publishes it
// with a release increment, so that the next block's acquire load sees the
// work complete. The deterministic Hopper backward keeps its dQ additions in
// key-block order with one counter per query block (BwdSm90DQOrder).
//
// Release is cumulative: memory operations of other threads of the block that
// a barrier ordered before the releasing thread (their dQ reductions) are
// visible to a thread that acquires the new count (the PTX memory model's
// release pattern, as CUTLASS's split-K semaphore uses it).
#pragma once

namespace flash {

// Spins until *counter >= turn (acquire, GPU scope). One thread calls it; the
// others of its block learn of it through a barrier.
__forceinline__ __device__ void semaphore_wait_for(const int* counter, int turn) {
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
  } while (seen < turn);
}

// *counter += 1 (release, GPU scope), after the work it publishes.
__forceinline__ __device__ void semaphore_release_increment(int* counter) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" : : "l"(counter) : "memory");
}

}  // namespace flash
