// CPU emulation of the CUDA subset csrc/recurrent/recurrent_cuda.cu uses, so its op bodies and
// kernels (compiled with FASTATTN_CUDA_EMULATION) run on CPU tensors on a machine without a GPU.
//
// Unlike cuda_emu.h (fibers, one block after another), a cooperative kernel needs every block
// resident at once (grid.sync()), so here each CUDA thread of a launch that synchronises is an OS
// thread: __syncthreads is a std::barrier per block, grid.sync() one per grid, warp shuffles a
// two-phase exchange per warp. Launches without synchronisation run their threads one after
// another. What this checks: the indexing, the masking, the ping-pong of the hidden state across
// grid.sync(), the path choice (occupancy and shared-memory limits of an emulated device) and
// the host bodies (GEMMs, workspace layout) against the CPU backend; device checks
// (FASTATTN_DEVICE_CHECK) are on. What it cannot: timing, memory-model subtleties (a missing
// __ldcg would not show: host memory is coherent), shared-memory races (use cuda_emu.h's
// detector for those; it does not handle grid.sync()).
#pragma once
#define FASTATTN_CUDA_EMULATION 1

#include <c10/core/Device.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using cudaStream_t = void*;
using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorCooperativeLaunchTooLarge = 720;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount,
  cudaDevAttrMaxSharedMemoryPerBlockOptin,
  cudaDevAttrCooperativeLaunch
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
#define FASTATTN_CUDA_CHECK(expr) TORCH_CHECK((expr) == 0, "emulated CUDA call failed: " #expr)

namespace emu_lstm {

// The emulated device: an H100 SXM by default (132 SMs, 227 KB opt-in shared memory per block,
// 228 KB per SM, 64K registers per SM).
struct Config {
  int sms = 132;
  int smem_optin = 227 * 1024;
  int smem_per_sm = 228 * 1024;
  int regs_per_sm = 65536;
  // registers per thread of the cooperative kernels, one value for both (ptxas -v, sm_90:
  // forward_persistent_kernel 80 float / 96 double, backward_persistent_kernel 128 / 156)
  int regs_per_thread = 96;
  int cooperative = 1;
  // SMs a cooperative launch may actually use (< sms: the occupancy query is too optimistic, as
  // under MPS); 0 = all
  int launch_sms = 0;
};
inline Config& config() {
  static Config c;
  return c;
}

struct Stats {
  std::atomic<int64_t> launches{0}, cooperative_launches{0};
};
inline Stats& stats() {
  static Stats s;
  return s;
}

struct Warp {
  std::barrier<> bar{32};
  unsigned char slots[32][8];
};
struct Block {
  std::unique_ptr<std::barrier<>> bar;
  std::vector<unsigned char> smem;
  std::vector<std::unique_ptr<Warp>> warps;
};
struct Ctx {
  dim3 tid, bid, bdim, gdim;
  Block* block = nullptr;
  std::barrier<>* grid_bar = nullptr;
  bool concurrent = false;
};
inline thread_local Ctx ctx;

[[noreturn]] inline void device_fail(const char* what, const char* file, int line) {
  std::fprintf(stderr, "emu_lstm: %s failed at %s:%d (block %u, thread %u)\n", what, file, line,
               ctx.bid.x, ctx.tid.x);
  std::abort();
}

struct ThreadArg {
  Ctx c;
  const std::function<void()>* body;
};

inline void* thread_main(void* p) {
  auto* a = static_cast<ThreadArg*>(p);
  ctx = a->c;
  (*a->body)();
  return nullptr;
}

// One launch: 1-D grids and blocks (all the recurrent engine uses). Returns the launch status (only
// a cooperative launch too large for the device fails, with cudaErrorCooperativeLaunchTooLarge).
inline int launch(dim3 grid, dim3 block, size_t smem, bool concurrent, bool cooperative,
                  const std::function<void()>& body) {
  stats().launches++;
  TORCH_CHECK(grid.y == 1 && grid.z == 1 && block.y == 1 && block.z == 1, "emu: 1-D launches only");
  TORCH_CHECK(grid.x >= 1 && block.x >= 1 && block.x <= 1024, "emu: bad launch configuration ",
              grid.x, " x ", block.x);
  TORCH_CHECK(smem <= static_cast<size_t>(config().smem_optin), "emu: ", smem,
              " bytes of shared memory exceed the device's ", config().smem_optin);
  if (cooperative) {
    const int per_sm = std::min<int>(
        {config().regs_per_sm / (config().regs_per_thread * static_cast<int>(block.x)),
         smem > 0 ? static_cast<int>(config().smem_per_sm / smem) : 32,
         2048 / static_cast<int>(block.x)});
    const int sms = config().launch_sms > 0 ? config().launch_sms : config().sms;
    if (static_cast<int64_t>(grid.x) > static_cast<int64_t>(per_sm) * sms) {
      return cudaErrorCooperativeLaunchTooLarge;
    }
    stats().cooperative_launches++;
  }
  std::vector<Block> blocks(concurrent ? grid.x : 1);
  for (Block& b : blocks) {
    b.bar = std::make_unique<std::barrier<>>(block.x);
    // Real shared memory starts as garbage: NaN bytes make an unwritten read visible.
    b.smem.assign(smem, 0xFF);
    for (unsigned w = 0; w < (block.x + 31) / 32; ++w) b.warps.push_back(std::make_unique<Warp>());
  }
  if (!concurrent) {
    Ctx c;
    c.gdim = grid;
    c.bdim = block;
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      std::fill(blocks[0].smem.begin(), blocks[0].smem.end(), 0xFF);
      c.bid = dim3(bx);
      c.block = &blocks[0];
      for (unsigned tx = 0; tx < block.x; ++tx) {
        c.tid = dim3(tx);
        ctx = c;
        body();
      }
    }
    ctx = Ctx();
    return cudaSuccess;
  }
  TORCH_CHECK(block.x % 32 == 0, "emu: concurrent launches need whole warps");
  const size_t n = static_cast<size_t>(grid.x) * block.x;
  std::barrier<> grid_bar(static_cast<std::ptrdiff_t>(n));
  std::vector<ThreadArg> args(n);
  std::vector<pthread_t> threads(n);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 256 * 1024);
  for (size_t i = 0; i < n; ++i) {
    Ctx& c = args[i].c;
    c.gdim = grid;
    c.bdim = block;
    c.bid = dim3(static_cast<unsigned>(i / block.x));
    c.tid = dim3(static_cast<unsigned>(i % block.x));
    c.block = &blocks[i / block.x];
    c.grid_bar = cooperative ? &grid_bar : nullptr;
    c.concurrent = true;
    args[i].body = &body;
    TORCH_CHECK(pthread_create(&threads[i], &attr, thread_main, &args[i]) == 0,
                "emu: cannot start thread ", i, " of ", n);
  }
  for (size_t i = 0; i < n; ++i) pthread_join(threads[i], nullptr);
  pthread_attr_destroy(&attr);
  return cudaSuccess;
}

}  // namespace emu_lstm

#define threadIdx (::emu_lstm::ctx.tid)
#define blockIdx (::emu_lstm::ctx.bid)
#define blockDim (::emu_lstm::ctx.bdim)
#define gridDim (::emu_lstm::ctx.gdim)

inline void __syncthreads() {
  if (!emu_lstm::ctx.concurrent)
    emu_lstm::device_fail("__syncthreads in a sequential launch", __FILE__, __LINE__);
  emu_lstm::ctx.block->bar->arrive_and_wait();
}

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  static_assert(sizeof(T) <= 8);
  if (!emu_lstm::ctx.concurrent || mask != 0xffffffffu) {
    emu_lstm::device_fail("__shfl_xor_sync needs a concurrent launch and a full mask", __FILE__,
                          __LINE__);
  }
  emu_lstm::Warp& w = *emu_lstm::ctx.block->warps[emu_lstm::ctx.tid.x / 32];
  const unsigned lane = emu_lstm::ctx.tid.x % 32;
  std::memcpy(w.slots[lane], &v, sizeof(T));
  w.bar.arrive_and_wait();
  T out;
  std::memcpy(&out, w.slots[lane ^ static_cast<unsigned>(lane_mask)], sizeof(T));
  w.bar.arrive_and_wait();
  return out;
}

namespace cooperative_groups {
struct grid_group {
  void sync() const {
    if (emu_lstm::ctx.grid_bar == nullptr) {
      emu_lstm::device_fail("grid.sync() outside a cooperative launch", __FILE__, __LINE__);
    }
    emu_lstm::ctx.grid_bar->arrive_and_wait();
  }
};
inline grid_group this_grid() { return {}; }
}  // namespace cooperative_groups

#define FASTATTN_LSTM_DYNAMIC_SMEM(name) unsigned char* name = ::emu_lstm::ctx.block->smem.data()
#define FASTATTN_LSTM_LDCG(p) (*(p))
#define FASTATTN_DEVICE_CHECK(cond)                                                               \
  do {                                                                                            \
    if (!(cond)) ::emu_lstm::device_fail("FASTATTN_DEVICE_CHECK(" #cond ")", __FILE__, __LINE__); \
  } while (0)
#define FASTATTN_CUDA_LAUNCH_CHECK() ((void)0)

#define FASTATTN_LSTM_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::emu_lstm::launch(dim3(grid), dim3(block), smem, false, false, [&] { kernel(__VA_ARGS__); })
#define FASTATTN_LSTM_LAUNCH_WARPSYNC(kernel, grid, block, smem, stream, ...) \
  ::emu_lstm::launch(dim3(grid), dim3(block), smem, true, false, [&] { kernel(__VA_ARGS__); })
#define FASTATTN_LSTM_LAUNCH_COOPERATIVE(err, kernel, grid, block, smem, stream, ...) \
  err = ::emu_lstm::launch(dim3(grid), dim3(block), smem, true, true, [&] { kernel(__VA_ARGS__); })

// common/cuda_api.h's device guard and current stream (one emulated device, no streams).
namespace fastattn {
struct CudaGuard {
  template <class T>
  explicit CudaGuard(const T&) {}
};
inline cudaStream_t current_cuda_stream(int = -1) { return nullptr; }
}  // namespace fastattn

inline int cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  const emu_lstm::Config& c = emu_lstm::config();
  *value = attr == cudaDevAttrMultiProcessorCount            ? c.sms
           : attr == cudaDevAttrMaxSharedMemoryPerBlockOptin ? c.smem_optin
                                                             : c.cooperative;
  return 0;
}
template <typename F>
inline int cudaFuncSetAttribute(F, cudaFuncAttribute, int bytes) {
  return bytes <= emu_lstm::config().smem_optin ? 0 : 1;
}
template <typename F>
inline int cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, F, int threads, size_t smem) {
  const emu_lstm::Config& c = emu_lstm::config();
  *n = std::min<int>({c.regs_per_sm / (c.regs_per_thread * threads),
                      smem > 0 ? static_cast<int>(c.smem_per_sm / smem) : 32, 2048 / threads});
  return 0;
}

namespace fastattn::cuda {
template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};
template <typename T>
using acc_t = typename AccType<T>::type;
template <typename T>
inline acc_t<T> to_acc(T v) {
  return static_cast<acc_t<T>>(v);
}
template <typename T>
inline T from_acc(acc_t<T> v) {
  return static_cast<T>(v);
}
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace fastattn::cuda
