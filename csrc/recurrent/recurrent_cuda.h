// The CUDA recurrent engine's shared pieces: the launch macros (the emulator, tools/cuda_emu,
// defines its own), launch geometry, the driver's outputs and its entry points, which the
// per-cell op bodies (csrc/lstm/lstm_cuda.cu, csrc/gru/gru_cuda.cu, csrc/rnn/rnn_cuda.cu) call.
#pragma once
#if !defined(FASTATTN_CUDA_EMULATION)
#include <cuda_runtime.h>

#include "common/cuda_api.h"
#else
#include "common/tensor_api.h"
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/debug.h"
#include "recurrent/recurrent.h"
#include "recurrent/recurrent_cuda_kernels.cuh"

#if !defined(FASTATTN_CUDA_EMULATION)
// kernel<<<grid, block, smem, stream>>>(args...); the _WARPSYNC form marks kernels with warp
// collectives (the emulator runs their threads concurrently).
#define FASTATTN_LSTM_LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#define FASTATTN_LSTM_LAUNCH_WARPSYNC FASTATTN_LSTM_LAUNCH
// Cooperative launch (grid.sync() inside): every block co-resident or the launch fails; the
// status goes to `err` (see cooperative_launched).
#define FASTATTN_LSTM_LAUNCH_COOPERATIVE(err, kernel, grid, block, smem, stream, ...)     \
  do {                                                                                    \
    auto fastattn_args = std::make_tuple(__VA_ARGS__);                                    \
    void* fastattn_ptrs[std::tuple_size_v<decltype(fastattn_args)>];                      \
    std::apply(                                                                           \
        [&](auto&... a) {                                                                 \
          int i = 0;                                                                      \
          ((fastattn_ptrs[i++] = static_cast<void*>(&a)), ...);                           \
        },                                                                                \
        fastattn_args);                                                                   \
    err = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), grid, block, \
                                      fastattn_ptrs, smem, stream);                       \
  } while (0)
#endif

namespace fastattn::recurrent {

using fastattn::cuda::acc_t;
using fastattn::cuda::ceil_div;
using std::optional;
namespace k = fastattn::recurrent::cuda_kernels;

#define FASTATTN_DISPATCH_LSTM_CUDA(TYPE, ...) \
  FASTATTN_DISPATCH_FLOATING(TYPE, "lstm_cuda", __VA_ARGS__)

constexpr int kThreads = 256;

inline dim3 grid_for(int64_t n) {
  return dim3(static_cast<unsigned>(std::max<int64_t>(ceil_div(n, kThreads), 1)));
}

// Grid-stride kernels: enough blocks to fill the GPU, no more.
inline dim3 grid_stride_for(int64_t n) {
  return dim3(
      static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(ceil_div(n, kThreads), 1), 65535)));
}

inline const int64_t* lengths_ptr(const optional<Tensor>& lengths) {
  return defined(lengths) ? lengths->data_ptr<int64_t>() : nullptr;
}

using k::Cell;
using k::CellInfo;

// f(std::integral_constant<Cell, C>{}) for the runtime cell c: the driver
// instantiates its kernels per cell.
template <typename F>
inline void with_cell(Cell c, F&& f) {
  switch (c) {
    case Cell::lstm:
      f(std::integral_constant<Cell, Cell::lstm>{});
      break;
    case Cell::gru:
      f(std::integral_constant<Cell, Cell::gru>{});
      break;
    case Cell::gru_reset_before:
      f(std::integral_constant<Cell, Cell::gru_reset_before>{});
      break;
    case Cell::rnn_tanh:
      f(std::integral_constant<Cell, Cell::rnn_tanh>{});
      break;
    case Cell::rnn_relu:
      f(std::integral_constant<Cell, Cell::rnn_relu>{});
      break;
  }
}

inline int gate_count(Cell c) {
  int G = 0;
  with_cell(c, [&](auto cc) { G = CellInfo<decltype(cc)::value>::G; });
  return G;
}

// The layer driver (recurrent_cuda.cu), one for every cell: the checks are the callers' (the
// per-cell op bodies); c0, w_hr only for the LSTM.
struct LayerOutputs {
  Tensor output, h_n, c_n, workspace;  // c_n undefined unless LSTM
};

LayerOutputs layer_forward_cuda(Cell cell, const LayerDims& d, const Tensor& input,
                                const Tensor& h0, const Tensor& c0, const Tensor& w_ih,
                                const Tensor& w_hh, const optional<Tensor>& b_ih,
                                const optional<Tensor>& b_hh, const optional<Tensor>& w_hr,
                                const optional<Tensor>& lengths, double dropout_p,
                                const optional<Tensor>& seed, bool save_workspace, const char* op);

struct LayerGrads {
  Tensor input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr;  // (0,) where not asked for
};

// gout, ghn, gcn: checked and contiguous, undefined where not given (zeros).
LayerGrads layer_backward_cuda(Cell cell, const LayerDims& d, const Tensor& gout, const Tensor& ghn,
                               const Tensor& gcn, const Tensor& input, const Tensor& h0,
                               const Tensor& c0, const Tensor& w_ih, const Tensor& w_hh,
                               const optional<Tensor>& w_hr, const optional<Tensor>& lengths,
                               const Tensor& workspace, double dropout_p,
                               const optional<Tensor>& seed, bool has_bias, bool input_grad,
                               bool weight_grad, const char* op);

// GRU (G = 3 gates r, z, n; E = 1 extra column) and RNN (G = 1, E = 0) layers: the op contract
// is fastattn/ops/_recurrent.py's, the CPU bodies csrc/gru/gru_cpu.cpp, csrc/rnn/rnn_cpu.cpp.
std::tuple<Tensor, Tensor, Tensor> gated_layer_cuda(
    Cell cell, const Tensor& input, const Tensor& h0, const Tensor& w_ih, const Tensor& w_hh,
    const optional<Tensor>& b_ih, const optional<Tensor>& b_hh, const optional<Tensor>& lengths,
    double dropout_p, const optional<Tensor>& seed, bool save_workspace, const char* op);

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gated_layer_backward_cuda(
    Cell cell, const optional<Tensor>& grad_output, const optional<Tensor>& grad_h_n,
    const Tensor& input, const Tensor& h0, const Tensor& w_ih, const Tensor& w_hh,
    const optional<Tensor>& lengths, const Tensor& workspace, double dropout_p,
    const optional<Tensor>& seed, bool has_bias, bool input_grad, bool weight_grad, const char* op);

}  // namespace fastattn::recurrent
