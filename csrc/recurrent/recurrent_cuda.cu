// The CUDA recurrent engine of every cell: the layer driver behind lstm_layer (op contract:
// fastattn/ops/lstm.py), gru_layer and rnn_layer (fastattn/ops/_recurrent.py), and lstm_cell.
// One driver (layer_forward_cuda / layer_backward_cuda) for every cell, the cell a template
// parameter of the kernels (k::Cell, recurrent_cuda_kernels.cuh: LSTM, GRU with the reset after or
// before W_hn, tanh / relu RNN), as the CPU engine (recurrent_cpu.cpp) is. Same structure as
// the CPU backend:
//   forward:  the input projection of every step as one cuBLAS GEMM per direction (both biases
//             folded in) into the workspace, then the recurrence, which leaves the activated
//             gates, c_t and h_t of every row in the workspace;
//   backward: reverse-time per-step cell derivative from the workspace (no GEMM recomputed),
//             dh_{t-1} = dgates W_hh per step (cuBLAS), then the weight and input gradients as
//             GEMMs over all steps.
// Recurrence paths, forward and backward (fastattn.ops.lstm.cuda_recurrent_path /
// torch.ops.fastattn.lstm_cuda_path reports the one a call takes):
//   kPersistent: one cooperative launch for all steps and both directions (no projection, the
//                grid fits co-resident, W_hh slices fit shared memory);
//   kPerStep:    per step one cuBLAS (batched over directions) h W_hh^T + a fused cell kernel
//                (+ the projection GEMM and a store kernel with w_hr).
//   The backward has the same two: a persistent kernel (W_hh column slices resident, dh of the
//   block's units from the previous step's dgates, cell derivative, grid.sync) or per step.
// FASTATTN_LSTM_CUDA_PATH=per_step in the environment forces the per-step path (tests compare
// the two).
// Lengths: per-row masking on the device (no host read of the lengths, no sort).
#include "recurrent/recurrent_cuda.h"

namespace fastattn::recurrent {
namespace {

// ---------------------------------------------------------------------------------------------
// Recurrent path choice

enum class RecurrentPath : int64_t { kPersistent = 0, kPerStep = 1 };

struct DeviceInfo {
  int sms = 0, smem_optin = 0, cooperative = 0;
};

DeviceInfo device_info(int device) {
  device = std::max(device, 0);  // the emulator's CPU tensors report -1
#if defined(FASTATTN_CUDA_EMULATION)
  DeviceInfo emulated;  // the emulated device changes between calls: no cache
  cudaDeviceGetAttribute(&emulated.sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&emulated.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  cudaDeviceGetAttribute(&emulated.cooperative, cudaDevAttrCooperativeLaunch, device);
  return emulated;
#endif
  static std::mutex mutex;
  static std::vector<DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<int>(cache.size()) <= device) cache.resize(device + 1);
  DeviceInfo& info = cache[device];
  if (info.sms == 0) {
    FASTATTN_CUDA_CHECK(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device));
    FASTATTN_CUDA_CHECK(
        cudaDeviceGetAttribute(&info.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    FASTATTN_CUDA_CHECK(
        cudaDeviceGetAttribute(&info.cooperative, cudaDevAttrCooperativeLaunch, device));
  }
  return info;
}

bool forced_per_step() {
  const char* env = std::getenv("FASTATTN_LSTM_CUDA_PATH");
  return env != nullptr && std::strcmp(env, "per_step") == 0;
}

// The persistent kernels' launch plan for a layer: units per block U (0: the persistent path
// cannot run this layer), the split of each block's product, the dynamic shared memory.
struct PersistentPlan {
  int U = 0;
  k::PersistentSplit split;
  size_t smem = 0;
};

// The smallest power of two U (most blocks) that puts at most one block on each SM, the W_hh
// slice and a split in shared memory, and every block co-resident; failing that (many units per
// SM needed to fit the slices), the smallest U whose grid is co-resident at all. One block per
// SM: a step's latency is one block's product plus one grid.sync(), and grid.sync() costs more
// with more blocks (the first H100 run, with the smallest co-resident U, had 512 blocks at
// H = 512). With G gate blocks (LSTM 4, GRU 3, RNN 1), forward: the block's product is
// (B, H) x (H, G U); backward: (B, G H) x (G H, U); G U <= 256.
template <typename scalar_t, typename Kernel>
PersistentPlan persistent_plan(const LayerDims& d, int device, Kernel kernel, bool backward,
                               int G) {
  using acc = acc_t<scalar_t>;
  PersistentPlan none;
  if (forced_per_step() || d.P != d.H || d.T == 0 || d.B == 0) return none;
  const DeviceInfo info = device_info(device);
  if (!info.cooperative) return none;
  const int64_t K = backward ? G * d.H : d.H;
  PersistentPlan fallback;
  for (int U = 1; U <= k::kPersistThreads / G; U *= 2) {
    const int N = backward ? U : G * U;
    PersistentPlan plan;
    plan.U = U;
    // larger U only needs more shared memory and covers fewer rows per thread group
    if (!k::choose_persistent_split<acc>(K, d.B, N, static_cast<size_t>(info.smem_optin),
                                         plan.split)) {
      break;
    }
    plan.smem = k::persistent_block_smem_bytes<acc>(K, d.B, N, plan.split);
    FASTATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(plan.smem)));
    int per_sm = 0;
    FASTATTN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, kernel, k::kPersistThreads, plan.smem));
    const int64_t blocks = d.D * ceil_div(d.H, U);
    if (per_sm <= 0 || blocks > static_cast<int64_t>(per_sm) * info.sms) continue;
    if (blocks <= info.sms) return plan;
    if (fallback.U == 0) fallback = plan;
  }
  return fallback;
}

// True when the cooperative launch ran. The occupancy query that chose the persistent path
// assumes the whole GPU; if the device cannot co-schedule the grid after all (MPS, another
// context holding SMs) the launch fails with cudaErrorCooperativeLaunchTooLarge, and the op
// runs the per-step path instead, with a warning (not silently). Any other error throws.
bool cooperative_launched(cudaError_t err, const char* op) {
  if (err == cudaErrorCooperativeLaunchTooLarge) {
    (void)cudaGetLastError();  // clear the (non-sticky) launch error
    // Once per process, on stderr (the stable ABI has no TORCH_WARN; Python's warnings are
    // out of reach from a kernel's host code).
    static std::once_flag warned;
    std::call_once(warned, [op] {
      std::fprintf(stderr,
                   "fastattn warning: %s: the persistent recurrent kernel's grid did not fit the "
                   "device at launch (cudaErrorCooperativeLaunchTooLarge; MPS or another "
                   "context?), so the per-step path ran; fastattn.ops.{lstm,gru,rnn}."
                   "cuda_recurrent_path report the occupancy query's prediction, which assumes "
                   "the whole GPU\n",
                   op);
    });
    return false;
  }
  FASTATTN_CUDA_CHECK(err);
  return true;
}

// The persistent plan of a layer of `cell` for `dtype` (U == 0: the per-step path). Computed
// once per layer call: its search sets the kernel's shared-memory attribute and queries the
// occupancy for every candidate U.
PersistentPlan plan_for(Cell cell, ScalarType dtype, const LayerDims& d, int device,
                        bool backward) {
  PersistentPlan plan;
  with_cell(cell, [&](auto cc) {
    constexpr Cell C = decltype(cc)::value;
    FASTATTN_DISPATCH_LSTM_CUDA(dtype, [&] {
      plan = backward
                 ? persistent_plan<scalar_t>(d, device, k::backward_persistent_kernel<scalar_t, C>,
                                             true, CellInfo<C>::G)
                 : persistent_plan<scalar_t>(d, device, k::forward_persistent_kernel<scalar_t, C>,
                                             false, CellInfo<C>::G);
    });
  });
  return plan;
}

RecurrentPath choose_path(Cell cell, ScalarType dtype, const LayerDims& d, int device,
                          bool backward = false) {
  return plan_for(cell, dtype, d, device, backward).U > 0 ? RecurrentPath::kPersistent
                                                          : RecurrentPath::kPerStep;
}

// ---------------------------------------------------------------------------------------------
// Shared pieces of the layer ops

struct Dropout {
  const int64_t* seed = nullptr;
  float threshold = 0.0f;
  double scale = 1.0;
};

Dropout make_dropout(double p, const optional<Tensor>& seed) {
  Dropout dr;
  if (p > 0.0) {
    dr.seed = seed->data_ptr<int64_t>();
    dr.threshold = static_cast<float>(p);
    dr.scale = 1.0 / (1.0 - p);
  }
  return dr;
}

// (T * B, I) acc: the input with dropout applied, rows time-major.
Tensor gathered_input(const Tensor& input, const Dropout& dr, cudaStream_t stream) {
  const int64_t T = input.size(0), B = input.size(1), I = input.size(2);
  const auto acc = compute_dtype(input.scalar_type());
  Tensor x = input.size(2) <= 1 || input.stride(2) == 1 ? input : input.contiguous();
  Tensor xp = empty({T * B, I}, input.options().dtype(acc));
  if (xp.numel() == 0) return xp;
  FASTATTN_DISPATCH_LSTM_CUDA(input.scalar_type(), [&] {
    using a = acc_t<scalar_t>;
    FASTATTN_LSTM_LAUNCH(k::gather_input_kernel<scalar_t>, grid_stride_for(T * B * I), kThreads, 0,
                         stream, x.data_ptr<scalar_t>(), T, B, I, x.stride(0), x.stride(1),
                         xp.data_ptr<a>(), dr.seed, dr.threshold, static_cast<a>(dr.scale));
    FASTATTN_CUDA_LAUNCH_CHECK();
  });
  return xp;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The layer driver, one for every cell (the CUDA twin of recurrent_cpu.cpp): the checks are the
// callers' (lstm_layer_cuda, gru_layer_cuda, rnn_layer_cuda below); c0, w_hr only for the LSTM.

LayerOutputs layer_forward_cuda(Cell cell, const LayerDims& d, const Tensor& input,
                                const Tensor& h0, const Tensor& c0, const Tensor& w_ih,
                                const Tensor& w_hh, const optional<Tensor>& b_ih,
                                const optional<Tensor>& b_hh, const optional<Tensor>& w_hr,
                                const optional<Tensor>& lengths, double dropout_p,
                                const optional<Tensor>& seed, bool save_workspace, const char* op) {
  CudaGuard guard(input);
  const bool lstm = cell == Cell::lstm;
  const bool two_phase = cell == Cell::gru_reset_before;
  const int64_t G = d.G, GH = d.G * d.H, G1H = (two_phase ? 2 : d.G) * d.H;
  const auto acc = compute_dtype(input.scalar_type());
  const auto opts = input.options();
  Tensor output = empty({d.T, d.B, d.D * d.P}, opts);
  Tensor h_n = empty({d.D, d.B, d.P}, opts);
  Tensor c_n = lstm ? empty({d.D, d.B, d.H}, opts) : Tensor();
  // Without save_workspace the states go to a call-local buffer and (0,) is returned.
  Tensor workspace = empty({d.D, workspace_per_direction(d)}, opts.dtype(acc));
  poison(output);
  poison(h_n);
  if (lstm) poison(c_n);
  poison(workspace);
  if (d.T == 0 || d.B == 0) {
    h_n.copy_(h0);
    if (lstm) c_n.copy_(c0);
    workspace.zero_();
    return {output, h_n, c_n, save_workspace ? workspace : empty({0}, opts.dtype(acc))};
  }
  auto stream = current_cuda_stream();
  const int64_t Bt = d.T * d.B;
  const int64_t* len = lengths_ptr(lengths);

  // Input projection of every step, the biases folded in (the reset-after GRU's b_hn stays
  // apart: it sits inside r * (W_hn h + b_hn)), into the workspace's gate rows.
  const Tensor xp = gathered_input(input, make_dropout(dropout_p, seed), stream);
  const Tensor w_ih_acc = w_ih.to(acc);
  Tensor bias, b_hn;
  if (defined(b_ih)) {
    Tensor hh = b_hh->to(acc);
    if (cell == Cell::gru) {
      b_hn = hh.narrow(1, 2 * d.H, d.H).contiguous();
      hh = hh.clone();
      hh.narrow(1, 2 * d.H, d.H).zero_();
    }
    bias = b_ih->to(acc).add(hh);
  }
  for (int64_t dir = 0; dir < d.D; ++dir) {
    Tensor gates = workspace[dir].narrow(0, 0, Bt * GH).view({Bt, GH});
    if (bias.defined()) {
      addmm_out(gates, bias[dir], xp, w_ih_acc[dir].t());
    } else {
      mm_out(gates, xp, w_ih_acc[dir].t());
    }
  }

  const Tensor w_hh_acc = w_hh.to(acc).contiguous();
  const k::ForwardStep fp{d.T, d.B, d.H, d.P, d.D, workspace_per_direction(d), len, defined(w_hr)};
  const PersistentPlan plan = plan_for(cell, input.scalar_type(), d, input.get_device(), false);
  bool persistent = plan.U > 0;
  // the LSTM's cell state; the reset-before GRU's r * h_{t-1} (unused by the other cells)
  Tensor c_state = lstm ? c0.to(acc).contiguous().clone() : empty({d.D, d.B, d.H}, opts.dtype(acc));
  if (persistent) {
    Tensor h_state = empty({2, d.D, d.B, d.H}, opts.dtype(acc));
    h_state[0].copy_(h0);
    Tensor rh_state = empty({two_phase ? d.D : 0, d.B, d.H}, opts.dtype(acc));
    with_cell(cell, [&](auto cc) {
      constexpr Cell C = decltype(cc)::value;
      FASTATTN_DISPATCH_LSTM_CUDA(input.scalar_type(), [&] {
        using a = acc_t<scalar_t>;
        k::PersistentParams pp{fp, plan.U, static_cast<int>(ceil_div(d.H, plan.U)), plan.split};
        const size_t smem = plan.smem;
        // the plan's search set the attribute for each candidate; this launch's must be the last
        FASTATTN_CUDA_CHECK(cudaFuncSetAttribute(k::forward_persistent_kernel<scalar_t, C>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem)));
        a* ws = workspace.data_ptr<a>();
        const a* whh = w_hh_acc.data_ptr<a>();
        a* hs = h_state.data_ptr<a>();
        a* cs = c_state.data_ptr<a>();
        scalar_t* out = output.data_ptr<scalar_t>();
        const a* bhn = b_hn.defined() ? b_hn.data_ptr<a>() : nullptr;
        a* rhs = two_phase ? rh_state.data_ptr<a>() : nullptr;
        cudaError_t err = cudaSuccess;
        const auto kernel = k::forward_persistent_kernel<scalar_t, C>;  // (no comma in the macro)
        FASTATTN_LSTM_LAUNCH_COOPERATIVE(
            err, kernel, dim3(static_cast<unsigned>(d.D * pp.blocks_per_dir)),
            dim3(k::kPersistThreads), smem, stream, pp, ws, whh, hs, cs, out, bhn, rhs);
        persistent = cooperative_launched(err, op);
      });
    });
    if (persistent) {
      h_n.copy_(h_state[d.T & 1]);
      if (lstm) c_n.copy_(c_state);
    }
  }
  if (!persistent) {
    Tensor h_state = h0.to(acc).contiguous().clone();
    if (lstm) c_state.copy_(c0);  // a failed cooperative launch may have left it changed
    Tensor hw = empty({d.D, d.B, G1H}, opts.dtype(acc));
    const Tensor w_hh_t = w_hh_acc.transpose(1, 2);  // (D, P, G H)
    const Tensor w_first_t = w_hh_t.narrow(2, 0, G1H);
    Tensor r_buf, hp, w_hr_t, w_n_t;
    if (fp.proj || two_phase) {
      r_buf = empty({d.D, d.B, d.H}, opts.dtype(acc));
      hp = empty({d.D, d.B, fp.proj ? d.P : d.H}, opts.dtype(acc));
    }
    if (fp.proj) w_hr_t = w_hr->to(acc).transpose(1, 2);    // (D, H, P)
    if (two_phase) w_n_t = w_hh_t.narrow(2, 2 * d.H, d.H);  // (D, H, H)
    with_cell(cell, [&](auto cc) {
      constexpr Cell C = decltype(cc)::value;
      FASTATTN_DISPATCH_LSTM_CUDA(input.scalar_type(), [&] {
        using a = acc_t<scalar_t>;
        a* rb = r_buf.defined() ? r_buf.data_ptr<a>() : nullptr;
        const a* bhn = b_hn.defined() ? b_hn.data_ptr<a>() : nullptr;
        const auto step_kernel = k::forward_step_cell_kernel<scalar_t, C>;
        for (int64_t s = 0; s < d.T; ++s) {
          bmm_out(hw, h_state, w_first_t);
          FASTATTN_LSTM_LAUNCH(step_kernel, grid_for(d.D * d.B * d.H), kThreads, 0, stream, fp, s,
                               0, workspace.data_ptr<a>(), hw.data_ptr<a>(), c_state.data_ptr<a>(),
                               h_state.data_ptr<a>(), rb, output.data_ptr<scalar_t>(), bhn);
          FASTATTN_CUDA_LAUNCH_CHECK();
          if (two_phase) {
            bmm_out(hp, r_buf, w_n_t);  // (r * h) W_hn^T
            FASTATTN_LSTM_LAUNCH(step_kernel, grid_for(d.D * d.B * d.H), kThreads, 0, stream, fp, s,
                                 1, workspace.data_ptr<a>(), hp.data_ptr<a>(),
                                 c_state.data_ptr<a>(), h_state.data_ptr<a>(), rb,
                                 output.data_ptr<scalar_t>(), bhn);
            FASTATTN_CUDA_LAUNCH_CHECK();
          }
          if (fp.proj) {
            bmm_out(hp, r_buf, w_hr_t);
            FASTATTN_LSTM_LAUNCH(k::forward_step_proj_kernel<scalar_t>, grid_for(d.D * d.B * d.P),
                                 kThreads, 0, stream, fp, s, workspace.data_ptr<a>(),
                                 hp.data_ptr<a>(), h_state.data_ptr<a>(),
                                 output.data_ptr<scalar_t>());
            FASTATTN_CUDA_LAUNCH_CHECK();
          }
        }
      });
    });
    h_n.copy_(h_state);
    if (lstm) c_n.copy_(c_state);
  }
  (void)G;
  return {output, h_n, c_n, save_workspace ? workspace : empty({0}, opts.dtype(acc))};
}

// gout, ghn, gcn: checked and contiguous, undefined where not given (zeros).
LayerGrads layer_backward_cuda(Cell cell, const LayerDims& d, const Tensor& gout, const Tensor& ghn,
                               const Tensor& gcn, const Tensor& input, const Tensor& h0,
                               const Tensor& c0, const Tensor& w_ih, const Tensor& w_hh,
                               const optional<Tensor>& w_hr, const optional<Tensor>& lengths,
                               const Tensor& workspace, double dropout_p,
                               const optional<Tensor>& seed, bool has_bias, bool input_grad,
                               bool weight_grad, const char* op) {
  CudaGuard guard(input);
  const bool lstm = cell == Cell::lstm;
  const bool two_phase = cell == Cell::gru_reset_before;
  const bool gru_after = cell == Cell::gru;
  const bool carry_h = cell == Cell::gru || two_phase;
  const int64_t GH = d.G * d.H, G1H = (two_phase ? 2 : d.G) * d.H, H = d.H;
  const auto acc = compute_dtype(input.scalar_type());
  const auto opts = input.options();
  const auto acc_opts = opts.dtype(acc);
  const bool proj = defined(w_hr);
  auto maybe_empty = [&](std::vector<int64_t> shape, bool wanted) {
    return empty(wanted ? shape : std::vector<int64_t>{0}, opts);
  };
  LayerGrads g;
  g.h0 = empty({d.D, d.B, d.P}, opts);
  g.c0 = empty({lstm ? d.D : 0, d.B, d.H}, opts);
  g.input = maybe_empty({d.T, d.B, d.I}, input_grad);
  g.w_ih = maybe_empty({d.D, GH, d.I}, weight_grad);
  g.w_hh = maybe_empty({d.D, GH, d.P}, weight_grad);
  g.b_ih = maybe_empty({d.D, GH}, weight_grad && has_bias);
  g.b_hh = maybe_empty({d.D, GH}, weight_grad && has_bias && !lstm);
  g.w_hr = maybe_empty({d.D, d.P, d.H}, weight_grad && proj);
  for (Tensor* t : {&g.h0, &g.c0, &g.input, &g.w_ih, &g.w_hh, &g.b_ih, &g.b_hh, &g.w_hr}) {
    poison(*t);
  }
  auto stream = current_cuda_stream();
  const int64_t Bt = d.T * d.B;
  // dL/dh carried backwards through time, and the per-unit carry: the LSTM's dL/dc, the GRU's
  // direct dL/dh_{t-1} part (missing incoming grads are zeros)
  Tensor dh_state =
      ghn.defined() ? ghn.to(acc).contiguous().clone() : zeros({d.D, d.B, d.P}, acc_opts);
  Tensor dc_state =
      lstm && gcn.defined() ? gcn.to(acc).contiguous().clone() : zeros({d.D, d.B, d.H}, acc_opts);
  Tensor dgates = empty({d.D, Bt, GH}, acc_opts);
  Tensor hprev = empty({d.D, Bt, d.P}, acc_opts);
  Tensor aux = empty({gru_after ? d.D : 0, Bt, d.H}, acc_opts);  // the GRU's d_n
  Tensor dh_all, r_all;
  if (proj) {
    dh_all = empty({d.D, Bt, d.P}, acc_opts);
    r_all = empty({d.D, Bt, d.H}, acc_opts);
  }
  const PersistentPlan plan =
      Bt > 0 ? plan_for(cell, input.scalar_type(), d, input.get_device(), true) : PersistentPlan{};
  bool persistent = plan.U > 0;
  const Tensor h0a = h0.to(acc).contiguous();
  const Tensor c0a = lstm ? c0.to(acc).contiguous() : Tensor();
  if (persistent) {
    const Tensor w_hh_acc = w_hh.to(acc).contiguous();  // (D, G H, H)
    const k::BackwardStep bp{
        d.T, d.B, d.H, d.P, d.D, workspace_per_direction(d), lengths_ptr(lengths), false};
    with_cell(cell, [&](auto cc) {
      constexpr Cell C = decltype(cc)::value;
      FASTATTN_DISPATCH_LSTM_CUDA(input.scalar_type(), [&] {
        using a = acc_t<scalar_t>;
        k::PersistentBackwardParams pp{bp, plan.U, static_cast<int>(ceil_div(d.H, plan.U)),
                                       plan.split};
        const size_t smem = plan.smem;
        FASTATTN_CUDA_CHECK(cudaFuncSetAttribute(k::backward_persistent_kernel<scalar_t, C>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem)));
        const a* wsp = workspace.data_ptr<a>();
        const a* whh = w_hh_acc.data_ptr<a>();
        const a* h0p = h0a.data_ptr<a>();
        const a* c0p = lstm ? c0a.data_ptr<a>() : nullptr;
        const scalar_t* go = gout.defined() ? gout.data_ptr<scalar_t>() : nullptr;
        a* dhs = dh_state.data_ptr<a>();
        a* dcs = dc_state.data_ptr<a>();
        a* dgp = dgates.data_ptr<a>();
        a* hpp = hprev.data_ptr<a>();
        a* auxp = gru_after ? aux.data_ptr<a>() : nullptr;
        cudaError_t err = cudaSuccess;
        const auto kernel = k::backward_persistent_kernel<scalar_t, C>;
        FASTATTN_LSTM_LAUNCH_COOPERATIVE(err, kernel,
                                         dim3(static_cast<unsigned>(d.D * pp.blocks_per_dir)),
                                         dim3(k::kPersistThreads), smem, stream, pp, wsp, whh, h0p,
                                         c0p, go, dhs, dcs, dgp, hpp, auxp);
        persistent = cooperative_launched(err, op);
      });
    });
  }
  if (!persistent && Bt > 0) {
    const Tensor w_hh_acc = w_hh.to(acc);  // (D, G H, P)
    Tensor w_hr_acc, dh_step, dr, dq;
    if (proj) {
      w_hr_acc = w_hr->to(acc);  // (D, P, H)
      dh_step = empty({d.D, d.B, d.P}, acc_opts);
      dr = empty({d.D, d.B, d.H}, acc_opts);
    }
    Tensor dg_step = empty({d.D, d.B, GH}, acc_opts);
    Tensor dhp = empty({d.D, d.B, d.P}, acc_opts);
    const Tensor dg_first = dg_step.narrow(2, 0, G1H);
    const Tensor w_first = w_hh_acc.narrow(1, 0, G1H);
    Tensor dn_step, w_n;
    if (two_phase) {
      dq = empty({d.D, d.B, d.H}, acc_opts);
      dn_step = dg_step.narrow(2, 2 * H, H);
      w_n = w_hh_acc.narrow(1, 2 * H, H);  // (D, H, H)
    }
    const k::BackwardStep bp{
        d.T, d.B, d.H, d.P, d.D, workspace_per_direction(d), lengths_ptr(lengths), proj};
    with_cell(cell, [&](auto cc) {
      constexpr Cell C = decltype(cc)::value;
      FASTATTN_DISPATCH_LSTM_CUDA(input.scalar_type(), [&] {
        using a = acc_t<scalar_t>;
        const scalar_t* go = gout.defined() ? gout.data_ptr<scalar_t>() : nullptr;
        a* auxp = gru_after ? aux.data_ptr<a>() : nullptr;
        const a* c0p = lstm ? c0a.data_ptr<a>() : nullptr;
        const auto cell_kernel = k::backward_step_cell_kernel<scalar_t, C>;
        const auto update_carry = k::backward_step_update_kernel<a, true>;
        const auto update = k::backward_step_update_kernel<a, false>;
        auto cell_step = [&](int64_t s, int phase) {
          FASTATTN_LSTM_LAUNCH(cell_kernel, grid_for(d.D * d.B * d.H), kThreads, 0, stream, bp, s,
                               phase, workspace.data_ptr<a>(), h0a.data_ptr<a>(), c0p,
                               proj ? dr.data_ptr<a>() : nullptr, dh_state.data_ptr<a>(), go,
                               dc_state.data_ptr<a>(), dgates.data_ptr<a>(), dg_step.data_ptr<a>(),
                               hprev.data_ptr<a>(), proj ? r_all.data_ptr<a>() : nullptr, auxp,
                               two_phase ? dq.data_ptr<a>() : nullptr);
          FASTATTN_CUDA_LAUNCH_CHECK();
        };
        for (int64_t s = d.T - 1; s >= 0; --s) {
          if (proj) {
            FASTATTN_LSTM_LAUNCH(k::backward_step_dh_kernel<scalar_t>, grid_for(d.D * d.B * d.P),
                                 kThreads, 0, stream, bp, s, dh_state.data_ptr<a>(), go,
                                 dh_all.data_ptr<a>(), dh_step.data_ptr<a>());
            FASTATTN_CUDA_LAUNCH_CHECK();
            bmm_out(dr, dh_step, w_hr_acc);  // (D, B, P) x (D, P, H)
          }
          cell_step(s, 0);
          if (two_phase) {
            bmm_out(dq, dn_step, w_n);  // d_n W_hn = dL/d(r * h)
            cell_step(s, 1);
          }
          bmm_out(dhp, dg_first, w_first);  // (D, B, G1 H) x (D, G1 H, P)
          if (carry_h) {
            FASTATTN_LSTM_LAUNCH(update_carry, grid_for(d.D * d.B * d.P), kThreads, 0, stream, bp,
                                 s, dhp.data_ptr<a>(), dc_state.data_ptr<a>(),
                                 dh_state.data_ptr<a>());
          } else {
            FASTATTN_LSTM_LAUNCH(update, grid_for(d.D * d.B * d.P), kThreads, 0, stream, bp, s,
                                 dhp.data_ptr<a>(), dc_state.data_ptr<a>(), dh_state.data_ptr<a>());
          }
          FASTATTN_CUDA_LAUNCH_CHECK();
        }
      });
    });
  }
  g.h0.copy_(dh_state);
  if (lstm) g.c0.copy_(dc_state);

  // The input-side pre-activation gradients: dgates, except the reset-after GRU's n columns,
  // which are d_n (aux), not r * d_n.
  Tensor din = dgates;
  if (gru_after && Bt > 0 && (weight_grad || input_grad)) {
    din = cat({dgates.narrow(2, 0, 2 * H), aux}, 2);
  }
  // Weight gradients: one GEMM over all time steps per direction. The reset-before GRU's W_hn
  // multiplies r * h_{t-1} (the workspace's extra columns), not h_{t-1}.
  if (weight_grad) {
    if (Bt == 0) {
      g.w_ih.zero_();
      g.w_hh.zero_();
      g.b_ih.zero_();
      g.b_hh.zero_();
      g.w_hr.zero_();
    } else {
      const Tensor xp = gathered_input(input, make_dropout(dropout_p, seed), stream);
      for (int64_t dir = 0; dir < d.D; ++dir) {
        g.w_ih[dir].copy_(mm(din[dir].t(), xp));
        if (two_phase) {
          const Tensor dg = dgates[dir];
          const Tensor rh = workspace[dir].narrow(0, Bt * GH, Bt * H).view({Bt, H});
          g.w_hh[dir].narrow(0, 0, 2 * H).copy_(mm(dg.narrow(1, 0, 2 * H).t(), hprev[dir]));
          g.w_hh[dir].narrow(0, 2 * H, H).copy_(mm(dg.narrow(1, 2 * H, H).t(), rh));
        } else {
          g.w_hh[dir].copy_(mm(dgates[dir].t(), hprev[dir]));
        }
        if (proj) g.w_hr[dir].copy_(mm(dh_all[dir].t(), r_all[dir]));
      }
      if (has_bias) {
        g.b_ih.copy_(din.sum(1));
        if (!lstm) g.b_hh.copy_(dgates.sum(1));
      }
    }
  }
  // Input gradient: one GEMM per direction, summed, then the dropout mask and the lengths.
  if (input_grad && input.numel() > 0) {
    const Tensor w = w_ih.to(acc);
    Tensor dx = mm(din[0], w[0]);
    if (d.D == 2) dx.addmm_(din[1], w[1]);
    const Dropout dr = make_dropout(dropout_p, seed);
    FASTATTN_DISPATCH_LSTM_CUDA(input.scalar_type(), [&] {
      using a = acc_t<scalar_t>;
      FASTATTN_LSTM_LAUNCH(k::scatter_grad_input_kernel<scalar_t>, grid_stride_for(Bt * d.I),
                           kThreads, 0, stream, dx.data_ptr<a>(), d.T, d.B, d.I,
                           lengths_ptr(lengths), g.input.data_ptr<scalar_t>(), dr.seed,
                           dr.threshold, static_cast<a>(dr.scale));
      FASTATTN_CUDA_LAUNCH_CHECK();
    });
  }
  return g;
}

// GRU (G = 3 gates r, z, n; E = 1 extra column) and RNN (G = 1, E = 0) layers: the op contract
// is fastattn/ops/_recurrent.py's, the CPU bodies csrc/gru/gru_cpu.cpp, csrc/rnn/rnn_cpu.cpp.
std::tuple<Tensor, Tensor, Tensor> gated_layer_cuda(
    Cell cell, const Tensor& input, const Tensor& h0, const Tensor& w_ih, const Tensor& w_hh,
    const optional<Tensor>& b_ih, const optional<Tensor>& b_hh, const optional<Tensor>& lengths,
    double dropout_p, const optional<Tensor>& seed, bool save_workspace, const char* op) {
  const int64_t G = gate_count(cell), E = G == 1 ? 0 : 1;
  const LayerDims d = check_gated_layer(input, h0, w_ih, w_hh, b_ih, b_hh, lengths, G, E, op);
  check_seed(seed, dropout_p, input, op);
  LayerOutputs o = layer_forward_cuda(cell, d, input, h0, Tensor(), w_ih, w_hh, b_ih, b_hh,
                                      std::nullopt, lengths, dropout_p, seed, save_workspace, op);
  return {o.output, o.h_n, o.workspace};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gated_layer_backward_cuda(
    Cell cell, const optional<Tensor>& grad_output, const optional<Tensor>& grad_h_n,
    const Tensor& input, const Tensor& h0, const Tensor& w_ih, const Tensor& w_hh,
    const optional<Tensor>& lengths, const Tensor& workspace, double dropout_p,
    const optional<Tensor>& seed, bool has_bias, bool input_grad, bool weight_grad,
    const char* op) {
  const int64_t G = gate_count(cell), E = G == 1 ? 0 : 1;
  const LayerDims d =
      check_gated_layer(input, h0, w_ih, w_hh, std::nullopt, std::nullopt, lengths, G, E, op);
  check_seed(seed, dropout_p, input, op);
  const auto [gout, ghn, gcn] =
      check_layer_backward(grad_output, grad_h_n, std::nullopt, input, workspace, d, op);
  LayerGrads g = layer_backward_cuda(cell, d, gout, ghn, Tensor(), input, h0, Tensor(), w_ih, w_hh,
                                     std::nullopt, lengths, workspace, dropout_p, seed, has_bias,
                                     input_grad, weight_grad, op);
  return {g.input, g.h0, g.w_ih, g.w_hh, g.b_ih, g.b_hh};
}

namespace {

// The recurrent path lstm_layer (backward = false) or lstm_layer_backward (true) takes for these
// arguments: 0 = persistent (one cooperative kernel for all steps), 1 = per step (cuBLAS + fused
// cell kernel per step).
int64_t lstm_cuda_path(const Tensor& input, const Tensor& w_hh, const optional<Tensor>& w_hr,
                       bool backward) {
  constexpr const char* op = "lstm_cuda_path";
  check_float_dtype(input, op, "input");
  FASTATTN_CHECK(input.dim() == 3 && w_hh.dim() == 3 && w_hh.size(1) % 4 == 0, op,
                 "input must be (T, B, I) and w_hh (D, 4H, P), got ", input.sizes(), " and ",
                 w_hh.sizes());
  CudaGuard guard(input);
  const int64_t H = w_hh.size(1) / 4;
  const LayerDims d{input.size(0),
                    input.size(1),
                    input.size(2),
                    w_hh.size(0),
                    H,
                    defined(w_hr) ? w_hh.size(2) : H};
  return static_cast<int64_t>(
      choose_path(Cell::lstm, input.scalar_type(), d, input.get_device(), backward));
}

// The same for gru_layer / rnn_layer: cell "gru" (reset after), "gru_reset_before",
// "rnn_tanh" or "rnn_relu"; w_hh (D, G H, H).
int64_t recurrent_cuda_path(const Tensor& input, const Tensor& w_hh, std::string_view cell_name,
                            bool backward) {
  constexpr const char* op = "recurrent_cuda_path";
  check_float_dtype(input, op, "input");
  Cell cell = Cell::gru;
  if (cell_name == "gru_reset_before") {
    cell = Cell::gru_reset_before;
  } else if (cell_name == "rnn_tanh") {
    cell = Cell::rnn_tanh;
  } else if (cell_name == "rnn_relu") {
    cell = Cell::rnn_relu;
  } else {
    FASTATTN_CHECK(cell_name == "gru", op,
                   "cell must be 'gru', 'gru_reset_before', 'rnn_tanh' or 'rnn_relu', got '",
                   std::string(cell_name), "'");
  }
  const int64_t G = gate_count(cell);
  FASTATTN_CHECK(
      input.dim() == 3 && w_hh.dim() == 3 && w_hh.size(2) >= 1 && w_hh.size(1) == G * w_hh.size(2),
      op, "input must be (T, B, I) and w_hh (D, ", G, "H, H), got ", input.sizes(), " and ",
      w_hh.sizes());
  CudaGuard guard(input);
  const int64_t H = w_hh.size(2);
  const LayerDims d{input.size(0), input.size(1), input.size(2), w_hh.size(0), H, H, G,
                    G == 1 ? 0 : 1};
  return static_cast<int64_t>(
      choose_path(cell, input.scalar_type(), d, input.get_device(), backward));
}

}  // namespace

#if !defined(FASTATTN_CUDA_EMULATION)
STABLE_TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("lstm_cuda_path", TORCH_BOX(&lstm_cuda_path));
  m.impl("recurrent_cuda_path", TORCH_BOX(&recurrent_cuda_path));
}
#endif

}  // namespace fastattn::recurrent
