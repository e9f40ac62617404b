// Host-side matrix products (common/gemm_cpu.h).
#include "common/gemm_cpu.h"

#include "common/tensor_api.h"

#include "common/check.h"
#include "common/cpu_isa.h"
#include "common/gemm_cpu_kernel.h"

namespace fastattn::cpu {

void matmul_into(Tensor out, const Tensor& a, const Tensor& b, const Tensor& bias, bool accumulate,
                 const Tensor& b_cols, int64_t k_block) {
  if (out.scalar_type() == kFloat && cpu_isa() >= Isa::avx2 && out.stride(1) == 1) {
    const int64_t N = out.size(1);
    GemmParams p{a.size(0),
                 N,
                 a.size(1),
                 a.data_ptr<float>(),
                 a.stride(0),
                 a.stride(1),
                 b.data_ptr<float>(),
                 b.stride(0),
                 b.stride(1),
                 b_cols.defined() ? b_cols.data_ptr<int64_t>() : nullptr,
                 out.data_ptr<float>(),
                 out.stride(0),
                 bias.defined() ? bias.data_ptr<float>() : nullptr,
                 accumulate,
                 k_block};
    FASTATTN_CPU_ISA_CALL(gemm_large, p);
    return;
  }
  if (b_cols.defined()) {
    // The columns of B gathered as rows of B^T: a weight's B is the transpose of a contiguous
    // matrix, whose rows copy as blocks; a gather along B's strided columns reads one float
    // per cache line (docs/design/cpu_kernels.md).
    matmul_into(out, a, b.t().index_select(0, b_cols).t(), bias, accumulate);
    return;
  }
  if (accumulate) {
    out.add_(mm(a, b));
    if (bias.defined()) out.add_(bias);
  } else if (bias.defined()) {
    addmm_out(out, bias, a, b);
  } else {
    mm_out(out, a, b);
  }
}

void mm_into(Tensor out, const Tensor& a, const Tensor& b) {
  if (out.scalar_type() == a.scalar_type()) {
    matmul_into(out, a, b, Tensor(), false, Tensor(), kReductionBlock);
  } else {
    Tensor tmp = empty({a.size(0), b.size(1)}, a.options());  // weight-sized
    matmul_into(tmp, a, b, Tensor(), false, Tensor(), kReductionBlock);
    out.copy_(tmp);
  }
}

bool bf16_products() { return cpu_isa() == Isa::avx512bf16; }

void matmul_bf16_into(Tensor out, const Tensor& a, const Tensor& w, const Tensor& bias,
                      bool accumulate, const Tensor& w_rows) {
  FASTATTN_CHECK(bf16_products() && a.scalar_type() == kBFloat16 && w.scalar_type() == kBFloat16 &&
                     out.scalar_type() == kFloat && a.stride(1) == 1 && w.stride(1) == 1 &&
                     out.stride(1) == 1,
                 "matmul_bf16_into",
                 "needs AVX512-BF16, bfloat16 operands with unit column "
                 "strides and a float output");
  const int64_t N = out.size(1);
  GemmBf16Params p{a.size(0),
                   N,
                   a.size(1),
                   static_cast<const uint16_t*>(a.data_ptr()),
                   a.stride(0),
                   static_cast<const uint16_t*>(w.data_ptr()),
                   w.stride(0),
                   w_rows.defined() ? w_rows.data_ptr<int64_t>() : nullptr,
                   out.data_ptr<float>(),
                   out.stride(0),
                   bias.defined() ? bias.data_ptr<float>() : nullptr,
                   accumulate};
  avx512bf16::gemm_large_bf16(p);
}

bool amx_products() { return bf16_products() && avx512bf16::amx_products(); }

void matmul_split_bf16_into(Tensor out, const Tensor& a, const Tensor& w, bool accumulate) {
  // A column of one element has any stride (contiguous() keeps such views as they are).
  auto unit_columns = [](const Tensor& t) { return t.size(1) == 1 || t.stride(1) == 1; };
  FASTATTN_CHECK(amx_products() && a.scalar_type() == kFloat && w.scalar_type() == kBFloat16 &&
                     out.scalar_type() == kFloat && unit_columns(a) && unit_columns(w) &&
                     unit_columns(out),
                 "matmul_split_bf16_into",
                 "needs AMX-BF16, a float a and a bfloat16 w with unit column strides and a "
                 "float output");
  GemmBf16Params p{a.size(0),
                   out.size(1),
                   a.size(1),
                   nullptr,
                   a.stride(0),
                   static_cast<const uint16_t*>(w.data_ptr()),
                   w.stride(0),
                   nullptr,
                   out.data_ptr<float>(),
                   out.stride(0),
                   nullptr,
                   accumulate,
                   a.data_ptr<float>()};
  avx512bf16::gemm_large_bf16(p);
}

}  // namespace fastattn::cpu
