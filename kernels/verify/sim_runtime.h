// sim_runtime.h: host-only support for compiling the kernels as plain C++ (SAGE_HOST_SIM).
// One OS thread runs one GPU thread; the caller starts a block's threads together, so
// `static` locals play the role of shared memory (one block at a time) and std::barrier plays
// __syncthreads / the per-wave sync of the WMMA emulation. For CPU tests only: slow, exact.
#ifndef SAGE_SIM_RUNTIME_H
#define SAGE_SIM_RUNTIME_H
#include <barrier>
#include <cmath>
#include <memory>

static thread_local int sim_t_tid = 0;
static int sim_g_bid[3] = {0, 0, 0};
static std::unique_ptr<std::barrier<>> sim_g_block;
static std::unique_ptr<std::barrier<>> sim_g_wave[32];

inline int sim_tid() { return sim_t_tid; }
inline int sim_bid(int i) { return sim_g_bid[i]; }
inline void sim_block_sync() { sim_g_block->arrive_and_wait(); }
inline void sim_warp_sync() { sim_g_wave[sim_t_tid / 32]->arrive_and_wait(); }
inline float sim_f16_to_f32(unsigned short b) { _Float16 h; __builtin_memcpy(&h, &b, 2); return (float)h; }
inline unsigned short sim_f32_to_f16(float f) { _Float16 h = (_Float16)f; unsigned short b; __builtin_memcpy(&b, &h, 2); return b; }

extern "C" {
// Called once per block, before its threads start.
void sim_begin_block(int bx, int by, int bz, int threads) {
  sim_g_bid[0] = bx; sim_g_bid[1] = by; sim_g_bid[2] = bz;
  sim_g_block.reset(new std::barrier<>(threads));
  for (int w = 0; w < (threads + 31) / 32; ++w) sim_g_wave[w].reset(new std::barrier<>(threads - 32 * w < 32 ? threads - 32 * w : 32));
}
// Called by each thread of the block before it runs the kernel function.
void sim_set_thread(int tid) { sim_t_tid = tid; }
}
#endif
