// csrc/lstm/lstm_cuda.cu compiled for the CPU (see emu_lstm.h): the CUDA op bodies registered as
// CPU kernels of torch.ops.fastattn_emu.lstm_* (same schemas as fastattn::lstm_*), plus the
// emulated device's configuration. Driven by tools/cuda_emu/run_lstm.py.
#include "emu_lstm.h"

#include <torch/extension.h>

#include "lstm/lstm_cuda.cu"

namespace fastattn {
std::atomic<bool>& poison_flag() {
  static std::atomic<bool> flag{true};  // outputs a kernel forgets to write read as NaN
  return flag;
}
}  // namespace fastattn

TORCH_LIBRARY(fastattn_emu, m) {
  m.def("lstm_cell(Tensor input, Tensor hx, Tensor cx, Tensor w_ih, Tensor w_hh, Tensor? b_ih, "
        "Tensor? b_hh) -> (Tensor, Tensor, Tensor)");
  m.def("lstm_cell_backward(Tensor? grad_hy, Tensor? grad_cy, Tensor input, Tensor hx, "
        "Tensor cx, Tensor w_ih, Tensor w_hh, Tensor workspace, bool has_bias) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("lstm_layer(Tensor input, Tensor h0, Tensor c0, Tensor w_ih, Tensor w_hh, Tensor? b_ih, "
        "Tensor? b_hh, Tensor? w_hr, Tensor? lengths, float dropout_p, Tensor? seed, "
        "bool save_workspace) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("lstm_layer_backward(Tensor? grad_output, Tensor? grad_h_n, Tensor? grad_c_n, "
        "Tensor input, Tensor h0, Tensor c0, Tensor w_ih, Tensor w_hh, Tensor? w_hr, "
        "Tensor? lengths, Tensor workspace, float dropout_p, Tensor? seed, bool has_bias, "
        "bool input_grad, bool weight_grad) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("lstm_cuda_path(Tensor input, Tensor w_hh, Tensor? w_hr, bool backward=False) -> int");
}

TORCH_LIBRARY_IMPL(fastattn_emu, CPU, m) {
  m.impl("lstm_cell", &fastattn::lstm::lstm_cell_cuda);
  m.impl("lstm_cell_backward", &fastattn::lstm::lstm_cell_backward_cuda);
  m.impl("lstm_layer", &fastattn::lstm::lstm_layer_cuda);
  m.impl("lstm_layer_backward", &fastattn::lstm::lstm_layer_backward_cuda);
  m.impl("lstm_cuda_path", &fastattn::lstm::lstm_cuda_path);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_device", [](int sms, int smem_optin, int cooperative, int launch_sms) {
    emu_lstm::config().sms = sms;
    emu_lstm::config().smem_optin = smem_optin;
    emu_lstm::config().cooperative = cooperative;
    emu_lstm::config().launch_sms = launch_sms;
  }, pybind11::arg("sms"), pybind11::arg("smem_optin"), pybind11::arg("cooperative"),
     pybind11::arg("launch_sms") = 0);
  m.def("cooperative_launches", [] { return emu_lstm::stats().cooperative_launches.load(); });
  m.def("launches", [] { return emu_lstm::stats().launches.load(); });
}
