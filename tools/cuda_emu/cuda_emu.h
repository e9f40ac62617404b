// CPU emulation of the CUDA subset the attention kernels use, so that their exact code (the
// csrc/attention/*.cuh bodies and launchers, compiled with FASTATTN_CUDA_EMULATION) runs and is
// checked on a machine without a GPU.
//
// Execution: every CUDA thread of a block is a fiber (ucontext); blocks run one after another.
// __syncthreads, __syncwarp and the warp collectives (shuffles, ldmatrix, mma.sync) are
// rendezvous points where fibers yield until their block (or warp) has arrived. A rendezvous that
// can never complete (divergent barrier, a thread that exited) is reported as a deadlock, and the
// lanes of a warp collective must all execute the same collective.
//
// Semantics written out from the PTX ISA: mma.m16n8k16 fragment layouts (A row, B col, f32 C/D),
// ldmatrix .x4 with and without .trans (row addresses from lanes 8i..8i+7 of matrix i; 16-byte
// aligned), cp.async with src-size zero fill, committed groups and wait_group N (the copy lands
// at the wait, the latest moment the PTX allows).
//
// Checks (each failure throws with the block, thread and address):
//   shared memory  out of the block's dynamic allocation; reads of bytes never written (real
//                  shared memory holds garbage, e.g. NaN); reads or writes of bytes with a
//                  cp.async in flight; read/write and write/write conflicts between threads with
//                  no __syncthreads (or, within a warp, __syncwarp) between them
//   global memory  reads outside the tensors of the launch (extents from sizes and strides),
//                  writes outside the outputs, two threads writing one address
//   misc           misaligned 16-byte accesses, cp.async pending at kernel exit, device checks
//                  (FASTATTN_DEVICE_CHECK)
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

using std::max;
using std::min;

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint4 {
  uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }

namespace emu {

[[noreturn]] void fail(const std::string& what);

// ---------------------------------------------------------------------------------------------
// Launch-wide state

struct Range {
  uintptr_t lo, hi;  // [lo, hi)
  bool writable;
  const char* name;
};

struct ShadowByte {
  uint32_t w_gen = 0, w_wgen = 0;  // block / warp barrier generation of the last write
  int16_t w_tid = -1;              // -1: never written
  uint32_t r_gen = UINT32_MAX, r_wgen = 0;
  int16_t r_tid = -1;   // last reader in r_gen; -2: several
  int8_t r_warp = -1;   // warp of the readers in r_gen; -2: several warps
  uint8_t pending = 0;  // cp.async copies in flight
};

struct CpAsyncOp {
  unsigned char* dst;
  unsigned char data[16];
};

struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  int tid = 0;
  bool done = false;
  std::vector<std::vector<CpAsyncOp>> groups;  // committed groups, oldest first
  std::vector<CpAsyncOp> open;                 // issued, not committed
};

struct Block {
  dim3 block_idx, grid_dim, block_dim;
  int nthreads = 0;
  std::vector<unsigned char> smem;
  std::vector<ShadowByte> shadow;
  uint32_t gen = 0;  // completed __syncthreads
  int arrived = 0;
  std::vector<uint32_t> wgen;  // completed __syncwarp per warp (plus block barriers)
  // Warp rendezvous (collectives and __syncwarp): two phases so slots are not reused early.
  std::vector<int> w_arrived;
  std::vector<uint64_t> w_round;
  std::vector<std::string> w_kind;
  std::vector<std::vector<std::vector<unsigned char>>> w_slots;  // [warp][lane] payload
};

struct State {
  std::vector<Range> ranges;
  std::unordered_map<uintptr_t, int64_t> global_writer;  // address -> block * 4096 + thread
  Block* block = nullptr;
  std::vector<std::unique_ptr<Fiber>> fibers;
  Fiber* cur = nullptr;
  ucontext_t sched;
  bool progress = false;
  std::string where;  // kernel name
  std::function<void()> body;
  std::string error;  // first failure inside a fiber
  bool failed = false;
  // "launcher signature | smem bytes" of every launch since the last clear (run.py checks which
  // tile variant a case reached).
  std::vector<std::string> launches;
};

State& st();

inline Fiber& me() { return *st().cur; }
inline Block& blk() { return *st().block; }
inline int tid() { return me().tid; }
inline int lane() { return tid() & 31; }
inline int warp() { return tid() >> 5; }

std::string who();

inline void yield() {
  swapcontext(&me().ctx, &st().sched);
  if (st().failed) throw std::runtime_error("aborted");
}

// ---------------------------------------------------------------------------------------------
// Barriers and warp rendezvous

inline void block_barrier() {
  Block& b = blk();
  const uint32_t my_gen = b.gen;
  st().progress = true;
  if (++b.arrived == b.nthreads) {
    b.arrived = 0;
    ++b.gen;
    for (auto& w : b.wgen) ++w;
    st().progress = true;
  } else {
    while (b.gen == my_gen) yield();
  }
}

// All 32 lanes deposit `in`; once every lane has, `f(slots)` runs on each lane; then the lanes
// wait for each other again so that a fast lane cannot overwrite its slot early.
inline void warp_rendezvous(
    const std::string& kind, const void* in, size_t n,
    const std::function<void(const std::vector<std::vector<unsigned char>>&)>& f) {
  Block& b = blk();
  const int w = warp(), l = lane();
  auto& slots = b.w_slots[w];
  if (b.w_arrived[w] == 0) b.w_kind[w] = kind;
  if (b.w_kind[w] != kind) {
    fail("divergent warp collective: lane " + std::to_string(l) + " runs " + kind +
         " while other lanes run " + b.w_kind[w]);
  }
  slots[l].assign(static_cast<const unsigned char*>(in), static_cast<const unsigned char*>(in) + n);
  const uint64_t round = b.w_round[w];
  st().progress = true;
  if (++b.w_arrived[w] == 32) {
    b.w_arrived[w] = 0;
    ++b.w_round[w];
    st().progress = true;
  } else {
    while (b.w_round[w] == round) yield();
  }
  f(slots);
  // Second phase: everyone has read the slots.
  const uint64_t round2 = b.w_round[w];
  if (b.w_arrived[w] == 0) b.w_kind[w] = kind + "/2";
  st().progress = true;
  if (++b.w_arrived[w] == 32) {
    b.w_arrived[w] = 0;
    ++b.w_round[w];
    st().progress = true;
  } else {
    while (b.w_round[w] == round2) yield();
  }
}

inline void warp_barrier() {
  warp_rendezvous("syncwarp", nullptr, 0, [](const auto&) {});
  // Memory ordering among the warp's lanes: every lane bumps after the rendezvous, so count
  // once per warp (lane 0).
  if (lane() == 0) ++blk().wgen[warp()];
  warp_rendezvous("syncwarp-done", nullptr, 0, [](const auto&) {});
}

// ---------------------------------------------------------------------------------------------
// Shared memory checks

inline size_t smem_offset(const void* p, size_t n, const char* what) {
  Block& b = blk();
  const auto base = reinterpret_cast<uintptr_t>(b.smem.data());
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a < base || a + n > base + b.smem.size()) {
    std::ostringstream os;
    os << what << " of " << n << " bytes at shared offset " << static_cast<int64_t>(a - base)
       << " outside the " << b.smem.size() << "-byte allocation";
    fail(os.str());
  }
  return a - base;
}

// Whether an access by this thread is ordered after an earlier one (gen, wgen) by thread t.
inline bool ordered_after(uint32_t gen, uint32_t wgen, int t) {
  Block& b = blk();
  if (t == tid()) return true;
  if (b.gen != gen) return true;                                  // a __syncthreads in between
  if ((t >> 5) == warp() && b.wgen[warp()] != wgen) return true;  // a __syncwarp in between
  return false;
}

inline void smem_read(const void* p, size_t n, const char* what) {
  const size_t off = smem_offset(p, n, what);
  Block& b = blk();
  for (size_t k = 0; k < n; ++k) {
    ShadowByte& s = b.shadow[off + k];
    if (s.pending)
      fail(std::string(what) + ": reads shared offset " + std::to_string(off + k) +
           " while a cp.async into it is in flight");
    if (s.w_tid == -1)
      fail(std::string(what) + ": reads shared offset " + std::to_string(off + k) +
           " that was never written");
    if (!ordered_after(s.w_gen, s.w_wgen, s.w_tid)) {
      fail(std::string(what) + ": reads shared offset " + std::to_string(off + k) +
           " written by thread " + std::to_string(s.w_tid) + " with no barrier in between");
    }
    if (s.r_gen != b.gen) {
      s.r_gen = b.gen;
      s.r_tid = static_cast<int16_t>(tid());
      s.r_warp = static_cast<int8_t>(warp());
      s.r_wgen = b.wgen[warp()];
    } else if (s.r_tid != tid()) {
      s.r_tid = -2;
      if (s.r_warp != warp()) s.r_warp = -2;
      s.r_wgen = std::min(s.r_wgen, b.wgen[warp()]);
    }
  }
}

inline void check_write_order(ShadowByte& s, size_t off, const char* what) {
  Block& b = blk();
  if (s.pending)
    fail(std::string(what) + ": writes shared offset " + std::to_string(off) +
         " while a cp.async into it is in flight");
  if (s.w_tid != -1 && !ordered_after(s.w_gen, s.w_wgen, s.w_tid)) {
    fail(std::string(what) + ": writes shared offset " + std::to_string(off) +
         " also written by thread " + std::to_string(s.w_tid) + " with no barrier in between");
  }
  if (s.r_gen == b.gen && s.r_tid != tid()) {
    const bool same_warp_synced = s.r_warp == warp() && b.wgen[warp()] != s.r_wgen;
    if (!same_warp_synced) {
      fail(std::string(what) + ": writes shared offset " + std::to_string(off) +
           " read by thread " + std::to_string(s.r_tid) +
           " (-2: several) with no barrier in between");
    }
  }
}

inline void smem_write(void* p, size_t n, const char* what) {
  const size_t off = smem_offset(p, n, what);
  Block& b = blk();
  for (size_t k = 0; k < n; ++k) {
    ShadowByte& s = b.shadow[off + k];
    check_write_order(s, off + k, what);
    s.w_gen = b.gen;
    s.w_wgen = b.wgen[warp()];
    s.w_tid = static_cast<int16_t>(tid());
    s.r_gen = UINT32_MAX;
  }
}

// ---------------------------------------------------------------------------------------------
// Global memory checks

inline void global_access(const void* p, size_t n, bool write, const char* what) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (const Range& r : st().ranges) {
    if (a >= r.lo && a + n <= r.hi) {
      if (write && !r.writable)
        fail(std::string(what) + ": writes into read-only tensor " + r.name);
      if (write) {
        const int64_t id = static_cast<int64_t>(blk().block_idx.x) * 4096 + tid();
        for (size_t k = 0; k < n; ++k) {
          auto [it, inserted] = st().global_writer.emplace(a + k, id);
          if (!inserted && it->second != id) {
            fail(std::string(what) + ": " + r.name +
                 " byte written by two threads (block*4096+thread " + std::to_string(it->second) +
                 " and " + std::to_string(id) + ")");
          }
        }
      }
      return;
    }
  }
  std::ostringstream os;
  os << what << ": " << (write ? "write" : "read") << " of " << n << " bytes at " << p
     << " outside every tensor of the launch";
  fail(os.str());
}

// An atomic read-modify-write: inside a writable tensor of the launch; several threads may
// add to one address (blocks run one after another, so the additions do not interleave).
inline void global_atomic(const void* p, size_t n, const char* what) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (const Range& r : st().ranges) {
    if (a >= r.lo && a + n <= r.hi) {
      if (!r.writable) fail(std::string(what) + ": adds into read-only tensor " + r.name);
      return;
    }
  }
  std::ostringstream os;
  os << what << ": atomic add of " << n << " bytes at " << p << " outside every tensor";
  fail(os.str());
}

// ---------------------------------------------------------------------------------------------
// Launch

void run_block(unsigned bx, dim3 grid, dim3 block, int smem_bytes);

void set_ranges(std::vector<Range> ranges);

template <typename P>
void launch(void (*kernel)(P), unsigned grid, int threads, int smem, void* stream, const P& params,
            const char* name) {
  (void)stream;
  st().where = name;
  st().launches.push_back(std::string(name) + " | smem " + std::to_string(smem));
  set_ranges(emu_ranges(params));  // found by ADL next to the parameter struct
  st().body = [kernel, &params]() { kernel(params); };
  st().global_writer.clear();
  for (unsigned bx = 0; bx < grid; ++bx) run_block(bx, dim3(grid), dim3(threads), smem);
}

}  // namespace emu

#define threadIdx (::dim3(static_cast<unsigned>(::emu::tid())))
#define blockIdx (::emu::blk().block_idx)
#define blockDim (::emu::blk().block_dim)
#define gridDim (::emu::blk().grid_dim)

#define FASTATTN_DEVICE_CHECK(cond)                                      \
  do {                                                                   \
    if (!(cond)) ::emu::fail("FASTATTN_DEVICE_CHECK(" #cond ") failed"); \
  } while (0)
#define FASTATTN_CUDA_LAUNCH_CHECK() ((void)0)
#define FASTATTN_SET_KERNEL_SMEM(kernel, bytes) ((void)0)
#define FASTATTN_NOINLINE __attribute__((noinline))
#define FASTATTN_LAUNCH_KERNEL(kernel, grid, block, smem, stream, params) \
  ::emu::launch(kernel, grid, block, smem, stream, params, __PRETTY_FUNCTION__)

namespace fastattn::cuda::prim {

struct F16 {};
struct BF16 {};

inline char* shared_base() { return reinterpret_cast<char*>(::emu::blk().smem.data()); }

template <typename T>
inline T ldg(const T* p) {
  ::emu::global_access(p, sizeof(T), false, "ldg");
  return *p;
}
template <typename T>
inline void stg(T* p, T v) {
  ::emu::global_access(p, sizeof(T), true, "stg");
  *p = v;
}
// atomicAdd: any thread of any block may add to the address (no two-writer check), which must
// lie in a writable tensor of the launch.
template <typename T>
inline void atomic_add(T* p, T v) {
  ::emu::global_atomic(p, sizeof(T), "atomic_add");
  *p += v;
}
template <typename T>
inline T lds(const T* p) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0) ::emu::fail("misaligned lds");
  ::emu::smem_read(p, sizeof(T), "lds");
  return *p;
}
template <typename T>
inline void sts(T* p, T v) {
  if (reinterpret_cast<uintptr_t>(p) % (sizeof(T) >= 16 ? 16 : alignof(T)) != 0)
    ::emu::fail("misaligned sts");
  ::emu::smem_write(p, sizeof(T), "sts");
  *p = v;
}

inline void block_sync() { ::emu::block_barrier(); }
inline void warp_sync() { ::emu::warp_barrier(); }

template <typename T>
inline T shfl_xor(T v, int lane_mask) {
  T out{};
  ::emu::warp_rendezvous("shfl_xor", &v, sizeof(T), [&](const auto& slots) {
    std::memcpy(&out, slots[::emu::lane() ^ lane_mask].data(), sizeof(T));
  });
  return out;
}

inline void cp_async_16(void* dst, const void* src, int src_bytes) {
  using namespace ::emu;
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0) fail("cp.async: dst not 16-byte aligned");
  if (src_bytes < 0 || src_bytes > 16) fail("cp.async: src-size out of [0, 16]");
  if (src_bytes > 0) {
    if (reinterpret_cast<uintptr_t>(src) % 16 != 0) fail("cp.async: src not 16-byte aligned");
    global_access(src, static_cast<size_t>(src_bytes), false, "cp.async src");
  }
  const size_t off = smem_offset(dst, 16, "cp.async dst");
  CpAsyncOp op;
  op.dst = static_cast<unsigned char*>(dst);
  std::memset(op.data, 0, 16);
  if (src_bytes > 0) std::memcpy(op.data, src, static_cast<size_t>(src_bytes));
  for (size_t k = 0; k < 16; ++k) {
    ShadowByte& s = blk().shadow[off + k];
    check_write_order(s, off + k, "cp.async dst");
    s.pending++;
  }
  me().open.push_back(op);
}

inline void cp_async_commit() {
  auto& f = ::emu::me();
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}

template <int N>
inline void cp_async_wait() {
  using namespace ::emu;
  auto& f = me();
  while (static_cast<int>(f.groups.size()) > N) {
    for (const CpAsyncOp& op : f.groups.front()) {
      const size_t off = smem_offset(op.dst, 16, "cp.async land");
      for (size_t k = 0; k < 16; ++k) {
        ShadowByte& s = blk().shadow[off + k];
        s.pending--;
        s.w_gen = blk().gen;
        s.w_wgen = blk().wgen[warp()];
        s.w_tid = static_cast<int16_t>(tid());
        s.r_gen = UINT32_MAX;
      }
      std::memcpy(op.dst, op.data, 16);
    }
    f.groups.erase(f.groups.begin());
  }
}

// ldmatrix .x4 (.trans): lanes 8i..8i+7 give the row addresses of matrix i.
inline void ldmatrix_impl(uint32_t (&r)[4], const void* row_addr, bool trans) {
  using namespace ::emu;
  if (reinterpret_cast<uintptr_t>(row_addr) % 16 != 0)
    fail("ldmatrix: row address not 16-byte aligned");
  smem_offset(row_addr, 16, "ldmatrix row");
  const void* addr = row_addr;
  uint32_t out[4] = {0, 0, 0, 0};
  warp_rendezvous(trans ? "ldmatrix.trans" : "ldmatrix", &addr, sizeof(addr),
                  [&](const auto& slots) {
                    const int l = lane();
                    for (int i = 0; i < 4; ++i) {
                      auto row_ptr = [&](int row) {
                        const void* a;
                        std::memcpy(&a, slots[8 * i + row].data(), sizeof(a));
                        return static_cast<const uint16_t*>(a);
                      };
                      uint16_t e0, e1;
                      if (!trans) {  // (row l/4, cols 2(l%4), 2(l%4)+1)
                        const uint16_t* rp = row_ptr(l / 4);
                        smem_read(rp + 2 * (l % 4), 4, "ldmatrix");
                        e0 = rp[2 * (l % 4)];
                        e1 = rp[2 * (l % 4) + 1];
                      } else {  // (rows 2(l%4), 2(l%4)+1, col l/4)
                        const uint16_t* r0 = row_ptr(2 * (l % 4));
                        const uint16_t* r1 = row_ptr(2 * (l % 4) + 1);
                        smem_read(r0 + l / 4, 2, "ldmatrix.trans");
                        smem_read(r1 + l / 4, 2, "ldmatrix.trans");
                        e0 = r0[l / 4];
                        e1 = r1[l / 4];
                      }
                      out[i] = static_cast<uint32_t>(e0) | (static_cast<uint32_t>(e1) << 16);
                    }
                  });
  for (int i = 0; i < 4; ++i) r[i] = out[i];
}
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row_addr) {
  ldmatrix_impl(r, row_addr, false);
}
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_addr) {
  ldmatrix_impl(r, row_addr, true);
}

template <typename Elem>
inline float to_float(uint16_t bits);
template <>
inline float to_float<F16>(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}
template <>
inline float to_float<BF16>(uint16_t bits) {
  return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
}
template <typename Elem>
inline uint16_t from_float(float v);
template <>
inline uint16_t from_float<F16>(float v) {
  return c10::Half(v).x;
}
template <>
inline uint16_t from_float<BF16>(float v) {
  return c10::BFloat16(v).x;
}

template <typename Elem>
inline uint32_t pack2(float lo, float hi) {
  return static_cast<uint32_t>(from_float<Elem>(lo)) |
         (static_cast<uint32_t>(from_float<Elem>(hi)) << 16);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D = A B + C with the fragment layouts of
// attention_cuda_prims.cuh.
template <typename Elem>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  using namespace ::emu;
  struct Payload {
    uint32_t a[4], b[2];
    float c[4];
  } in;
  for (int k = 0; k < 4; ++k) in.a[k] = a[k], in.c[k] = d[k];
  in.b[0] = b0;
  in.b[1] = b1;
  float out[4];
  warp_rendezvous("mma", &in, sizeof(in), [&](const auto& slots) {
    float A[16][16], B[16][8];
    for (int L = 0; L < 32; ++L) {
      Payload p;
      std::memcpy(&p, slots[L].data(), sizeof(p));
      const int g = L / 4, t = L % 4;
      auto lo = [](uint32_t v) { return to_float<Elem>(static_cast<uint16_t>(v & 0xffff)); };
      auto hi = [](uint32_t v) { return to_float<Elem>(static_cast<uint16_t>(v >> 16)); };
      A[g][2 * t] = lo(p.a[0]);
      A[g][2 * t + 1] = hi(p.a[0]);
      A[g + 8][2 * t] = lo(p.a[1]);
      A[g + 8][2 * t + 1] = hi(p.a[1]);
      A[g][2 * t + 8] = lo(p.a[2]);
      A[g][2 * t + 9] = hi(p.a[2]);
      A[g + 8][2 * t + 8] = lo(p.a[3]);
      A[g + 8][2 * t + 9] = hi(p.a[3]);
      B[2 * t][g] = lo(p.b[0]);
      B[2 * t + 1][g] = hi(p.b[0]);
      B[2 * t + 8][g] = lo(p.b[1]);
      B[2 * t + 9][g] = hi(p.b[1]);
    }
    const int l = lane(), g = l / 4, t = l % 4;
    Payload mine;
    std::memcpy(&mine, slots[l].data(), sizeof(mine));
    for (int e = 0; e < 4; ++e) {
      const int row = g + (e >> 1) * 8, col = 2 * t + (e & 1);
      float acc = mine.c[e];
      for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
      out[e] = acc;
    }
  });
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

inline float fast_exp2(float x) { return std::exp2(x); }
inline float acc_exp(float x) { return std::exp(x); }
inline double acc_exp(double x) { return std::exp(x); }
inline float acc_log(float x) { return std::log(x); }
inline double acc_log(double x) { return std::log(x); }
inline float acc_tanh(float x) { return std::tanh(x); }
inline double acc_tanh(double x) { return std::tanh(x); }
inline float acc_fma(float a, float b, float c) { return std::fma(a, b, c); }
inline double acc_fma(double a, double b, double c) { return std::fma(a, b, c); }
inline float acc_max(float a, float b) { return std::fmax(a, b); }
inline double acc_max(double a, double b) { return std::fmax(a, b); }

}  // namespace fastattn::cuda::prim
