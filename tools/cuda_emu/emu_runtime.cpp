// Fiber scheduler and failure reporting of the CUDA emulator (cuda_emu.h).
#include "cuda_emu.h"

namespace emu {

State& st() {
  static State s;
  return s;
}

std::string who() {
  std::ostringstream os;
  os << "cuda_emu: " << st().where;
  if (st().block != nullptr) {
    os << " block " << st().block->block_idx.x;
    if (st().cur != nullptr) os << " thread " << st().cur->tid;
  }
  return os.str();
}

void fail(const std::string& what) { throw std::runtime_error(who() + ": " + what); }

void set_ranges(std::vector<Range> ranges) { st().ranges = std::move(ranges); }

namespace {

constexpr size_t kStackBytes = 256 * 1024;

void fiber_entry() {
  State& s = st();
  Fiber& f = *s.cur;
  try {
    s.body();
    if (!f.open.empty()) fail("cp.async issued but never committed at kernel exit");
    for (const auto& g : f.groups) {
      if (!g.empty()) fail("cp.async group still in flight at kernel exit");
    }
  } catch (const std::exception& e) {
    if (!s.failed) {
      s.failed = true;
      s.error = e.what();
    }
  }
  f.done = true;
  s.progress = true;
  // returning resumes the scheduler (uc_link)
}

}  // namespace

void run_block(unsigned bx, dim3 grid, dim3 block, int smem_bytes) {
  State& s = st();
  Block b;
  b.block_idx = dim3(bx);
  b.grid_dim = grid;
  b.block_dim = block;
  b.nthreads = static_cast<int>(block.x);
  if (b.nthreads % 32 != 0) fail("block size must be a multiple of 32");
  const int warps = b.nthreads / 32;
  // Real shared memory starts with garbage; 0xFF bytes are NaN for every float type.
  b.smem.assign(static_cast<size_t>(smem_bytes) + 16, 0xFF);
  // 16-byte alignment of the dynamic allocation, as on the device.
  const auto base = reinterpret_cast<uintptr_t>(b.smem.data());
  const size_t pad = (16 - base % 16) % 16;
  b.smem.erase(b.smem.begin(), b.smem.begin() + static_cast<long>(pad));
  b.smem.resize(static_cast<size_t>(smem_bytes));
  if (reinterpret_cast<uintptr_t>(b.smem.data()) % 16 != 0) fail("could not align shared memory");
  b.shadow.assign(static_cast<size_t>(smem_bytes), ShadowByte{});
  b.wgen.assign(warps, 0);
  b.w_arrived.assign(warps, 0);
  b.w_round.assign(warps, 0);
  b.w_kind.assign(warps, "");
  b.w_slots.assign(warps, std::vector<std::vector<unsigned char>>(32));
  s.block = &b;
  s.failed = false;
  s.error.clear();

  while (static_cast<int>(s.fibers.size()) < b.nthreads) {
    auto f = std::make_unique<Fiber>();
    f->stack.reset(new char[kStackBytes]);
    s.fibers.push_back(std::move(f));
  }
  for (int t = 0; t < b.nthreads; ++t) {
    Fiber& f = *s.fibers[t];
    f.tid = t;
    f.done = false;
    f.groups.clear();
    f.open.clear();
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &s.sched;
    makecontext(&f.ctx, fiber_entry, 0);
  }

  int idle_rounds = 0;
  while (true) {
    bool any = false;
    s.progress = false;
    for (int t = 0; t < b.nthreads; ++t) {
      Fiber& f = *s.fibers[t];
      if (f.done) continue;
      any = true;
      s.cur = &f;
      swapcontext(&s.sched, &f.ctx);
    }
    s.cur = nullptr;
    if (!any) break;
    if (s.progress || s.failed) {
      idle_rounds = 0;
      continue;
    }
    if (++idle_rounds >= 2) {
      std::ostringstream os;
      os << "deadlock: " << b.arrived << " of " << b.nthreads << " threads wait at __syncthreads;";
      for (int w = 0; w < warps; ++w) {
        if (b.w_arrived[w])
          os << " warp " << w << ": " << b.w_arrived[w] << " lanes in " << b.w_kind[w] << ";";
      }
      int done = 0;
      for (int t = 0; t < b.nthreads; ++t) done += s.fibers[t]->done ? 1 : 0;
      os << " " << done << " threads exited";
      s.failed = true;
      s.error = who() + ": " + os.str();
    }
  }
  s.block = nullptr;
  if (s.failed) throw std::runtime_error(s.error);
}

}  // namespace emu
