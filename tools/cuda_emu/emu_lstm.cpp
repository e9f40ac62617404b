// The CUDA recurrent engine (csrc/recurrent/recurrent_cuda.cu) and the per-cell op bodies
// (csrc/{lstm,gru,rnn}/*_cuda.cu) compiled for the CPU (see emu_lstm.h), registered as
// CPU kernels of torch.ops.fastattn_emu.{lstm,gru,rnn}_* (the schemas of fastattn::*, from
// csrc/op_schemas.h), plus the emulated device's configuration. Driven by
// tools/cuda_emu/run_lstm.py.
#include "emu_lstm.h"

#include <torch/extension.h>

#include "gru/gru_cuda.cu"
#include "lstm/lstm_cuda.cu"
#include "recurrent/recurrent_cuda.cu"
#include "rnn/rnn_cuda.cu"
#include "op_schemas.h"

namespace fastattn {
std::atomic<bool>& poison_flag() {
  static std::atomic<bool> flag{true};  // outputs a kernel forgets to write read as NaN
  return flag;
}
}  // namespace fastattn

// The same schemas as fastattn::lstm_* (csrc/op_schemas.h), under another library name so that
// the emulated ops sit next to the real ones; registered on the stable ABI as the real ones.
STABLE_TORCH_LIBRARY(fastattn_emu, m) {
  fastattn::schemas::define_lstm(m);
  fastattn::schemas::define_gru_rnn(m);
}

STABLE_TORCH_LIBRARY_IMPL(fastattn_emu, CPU, m) {
  m.impl("lstm_cell", TORCH_BOX(&fastattn::recurrent::lstm_cell_cuda));
  m.impl("lstm_cell_backward", TORCH_BOX(&fastattn::recurrent::lstm_cell_backward_cuda));
  m.impl("lstm_layer", TORCH_BOX(&fastattn::recurrent::lstm_layer_cuda));
  m.impl("lstm_layer_backward", TORCH_BOX(&fastattn::recurrent::lstm_layer_backward_cuda));
  m.impl("lstm_cuda_path", TORCH_BOX(&fastattn::recurrent::lstm_cuda_path));
  m.impl("gru_layer", TORCH_BOX(&fastattn::recurrent::gru_layer_cuda));
  m.impl("gru_layer_backward", TORCH_BOX(&fastattn::recurrent::gru_layer_backward_cuda));
  m.impl("rnn_layer", TORCH_BOX(&fastattn::recurrent::rnn_layer_cuda));
  m.impl("rnn_layer_backward", TORCH_BOX(&fastattn::recurrent::rnn_layer_backward_cuda));
  m.impl("recurrent_cuda_path", TORCH_BOX(&fastattn::recurrent::recurrent_cuda_path));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "set_device",
      [](int sms, int smem_optin, int cooperative, int launch_sms) {
        emu_lstm::config().sms = sms;
        emu_lstm::config().smem_optin = smem_optin;
        emu_lstm::config().cooperative = cooperative;
        emu_lstm::config().launch_sms = launch_sms;
      },
      pybind11::arg("sms"), pybind11::arg("smem_optin"), pybind11::arg("cooperative"),
      pybind11::arg("launch_sms") = 0);
  m.def("cooperative_launches", [] { return emu_lstm::stats().cooperative_launches.load(); });
  m.def("launches", [] { return emu_lstm::stats().launches.load(); });
}
