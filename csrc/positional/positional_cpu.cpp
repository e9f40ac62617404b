// CPU bodies of the positional-encoding ops: checks, allocation, and the ISA-dispatched loops of
// positional_cpu_kernel.cpp.
#include "common/tensor_api.h"

#include "common/cpu_huge_pages.h"
#include "common/cpu_isa.h"
#include "common/debug.h"
#include "positional/positional.h"
#include "positional/positional_cpu.h"
#include "positional/positional_cpu_kernel.h"

namespace fastattn::positional {
namespace {

using std::optional;

const int64_t* optional_ptr(const optional<Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<int64_t>() : nullptr;
}

std::pair<uint64_t, uint64_t> read_seed(const optional<Tensor>& seed, double p) {
  if (p <= 0.0) return {0, 0};
  const int64_t* s = seed->data_ptr<int64_t>();
  return {static_cast<uint64_t>(s[0]), static_cast<uint64_t>(s[1])};
}

#define FASTATTN_DISPATCH_FLOATS(TYPE, NAME, ...) \
  FASTATTN_DISPATCH_FLOATING(TYPE, NAME, __VA_ARGS__)

Tensor sinusoidal_table_cpu(const Tensor& positions, int64_t dim, double base, ScalarType dtype) {
  constexpr const char* op = "sinusoidal_table";
  FASTATTN_CHECK(positions.scalar_type() == kLong, op, "positions must be int64, got ",
                 positions.scalar_type());
  FASTATTN_CHECK(dim >= 1, op, "dim must be >= 1, got ", dim);
  FASTATTN_CHECK(base > 0.0, op, "base must be > 0, got ", base);
  auto sizes = positions.sizes().vec();
  sizes.push_back(dim);
  Tensor out = empty(sizes, positions.options().dtype(dtype));
  cpu::advise_huge_pages(out);
  poison(out);
  Tensor flat = positions.contiguous();
  cpu::SinusoidTableParams p{flat.data_ptr<int64_t>(), out.data_ptr(), flat.numel(), dim, base};
  FASTATTN_DISPATCH_FLOATS(dtype, "positional",
                           [&] { FASTATTN_CPU_ISA_CALL(sinusoidal_table<scalar_t>, p); });
  return out;
}

// out = dropout(x * scale [+ PE]); out is x's layout (a fresh empty_like) or x itself.
void add_sinusoidal_into(const Tensor& x, const Tensor& out, int64_t offset,
                         const optional<Tensor>& offsets, double scale, double base,
                         double dropout_p, const optional<Tensor>& seed, bool add_pe,
                         const char* op) {
  check_add_sinusoidal(x, offsets, base, dropout_p, seed, op);
  if (x.numel() == 0) return;
  auto [s, stream] = read_seed(seed, dropout_p);
  cpu::AddSinusoidalParams p{x.data_ptr(),
                             out.data_ptr(),
                             x.size(0),
                             x.size(1),
                             x.size(2),
                             x.stride(0),
                             x.stride(1),
                             out.stride(0),
                             out.stride(1),
                             offset,
                             optional_ptr(offsets),
                             scale,
                             base,
                             dropout_p,
                             s,
                             stream,
                             add_pe};
  FASTATTN_DISPATCH_FLOATS(x.scalar_type(), "positional",
                           [&] { FASTATTN_CPU_ISA_CALL(add_sinusoidal<scalar_t>, p); });
}

Tensor add_sinusoidal_cpu(const Tensor& x, int64_t offset, const optional<Tensor>& offsets,
                          double scale, double base, double dropout_p,
                          const optional<Tensor>& seed) {
  Tensor out = empty_like(x);  // keeps x's layout: (L, B, D) input viewed as (B, L, D)
  cpu::advise_huge_pages(out);
  poison(out);
  add_sinusoidal_into(x, out, offset, offsets, scale, base, dropout_p, seed, true,
                      "add_sinusoidal");
  return out;
}

// Each row is read completely before it is written, so out may be x itself.
void add_sinusoidal_inplace_cpu(const Tensor& x, int64_t offset, const optional<Tensor>& offsets,
                                double scale, double base, double dropout_p,
                                const optional<Tensor>& seed) {
  add_sinusoidal_into(x, x, offset, offsets, scale, base, dropout_p, seed, true, "add_sinusoidal_");
}

Tensor add_sinusoidal_backward_cpu(const Tensor& grad, double scale, double dropout_p,
                                   const optional<Tensor>& seed) {
  Tensor out = empty_like(grad);
  cpu::advise_huge_pages(out);
  poison(out);
  add_sinusoidal_into(grad, out, 0, std::nullopt, scale, 10000.0, dropout_p, seed, false,
                      "add_sinusoidal_backward");
  return out;
}

Tensor embed_with_positions_cpu(const Tensor& tokens, const Tensor& weight,
                                const optional<Tensor>& table, int64_t offset,
                                const optional<Tensor>& offsets, double scale, double base,
                                double dropout_p, const optional<Tensor>& seed, int64_t padding_idx,
                                bool deterministic) {
  // padding_idx and deterministic only matter to the backward (they are saved for it).
  (void)padding_idx;
  (void)deterministic;
  constexpr const char* op = "embed_with_positions";
  check_embed(tokens, weight, table, offset, offsets, dropout_p, seed, op);
  const int64_t N = tokens.size(0), L = tokens.size(1), D = weight.size(1);
  Tensor out = empty({N, L, D}, weight.options());
  cpu::advise_huge_pages(out);
  poison(out);
  if (out.numel() == 0) return out;
  Tensor tok = tokens.contiguous();
  const bool has_table = table.has_value() && table->defined();
  auto [s, stream] = read_seed(seed, dropout_p);
  cpu::EmbedParams p{tok.data_ptr<int64_t>(),
                     weight.data_ptr(),
                     has_table ? table->data_ptr() : nullptr,
                     out.data_ptr(),
                     N,
                     L,
                     D,
                     weight.stride(0),
                     has_table ? table->stride(0) : 0,
                     offset,
                     optional_ptr(offsets),
                     scale,
                     base,
                     dropout_p,
                     s,
                     stream};
  FASTATTN_DISPATCH_FLOATS(weight.scalar_type(), "positional",
                           [&] { FASTATTN_CPU_ISA_CALL(embed_with_positions<scalar_t>, p); });
  return out;
}

std::tuple<Tensor, Tensor> embed_with_positions_backward_cpu(
    const Tensor& grad, const Tensor& tokens, int64_t num_weights, int64_t padding_idx,
    int64_t table_rows, int64_t offset, const optional<Tensor>& offsets, double scale,
    double dropout_p, const optional<Tensor>& seed, bool deterministic) {
  // The CPU kernel always sums in a fixed order, so `deterministic` changes nothing here.
  (void)deterministic;
  constexpr const char* op = "embed_with_positions_backward";
  check_float_dtype(grad, op, "grad");
  FASTATTN_CHECK(grad.dim() == 3 && tokens.dim() == 2 && grad.size(0) == tokens.size(0) &&
                     grad.size(1) == tokens.size(1),
                 op, "grad must be (N, L, D) matching tokens (N, L), got ", grad.sizes(), " and ",
                 tokens.sizes());
  FASTATTN_CHECK(tokens.scalar_type() == kLong, op, "tokens must be int64");
  check_offsets(offsets, tokens.size(0), grad, op);
  check_seed(seed, dropout_p, grad, op);
  const int64_t N = grad.size(0), L = grad.size(1), D = grad.size(2);
  Tensor grad_weight = empty({num_weights, D}, grad.options());
  Tensor grad_table = empty({std::max<int64_t>(table_rows, 0), D}, grad.options());
  poison(grad_weight);
  poison(grad_table);
  Tensor g = grad.contiguous();
  Tensor tok = tokens.contiguous();
  auto [s, stream] = read_seed(seed, dropout_p);
  cpu::EmbedBackwardParams p{g.data_ptr(),
                             tok.data_ptr<int64_t>(),
                             grad_weight.data_ptr(),
                             table_rows >= 0 ? grad_table.data_ptr() : nullptr,
                             N,
                             L,
                             D,
                             num_weights,
                             table_rows,
                             padding_idx,
                             offset,
                             optional_ptr(offsets),
                             scale,
                             dropout_p,
                             s,
                             stream};
  FASTATTN_DISPATCH_FLOATS(grad.scalar_type(), "positional", [&] {
    FASTATTN_CPU_ISA_CALL(embed_with_positions_backward<scalar_t>, p);
  });
  return {grad_weight, grad_table};
}

void apply_rotary_into(const Tensor& x, const Tensor& out, const optional<Tensor>& cos,
                       const optional<Tensor>& sin, int64_t offset, const optional<Tensor>& offsets,
                       const optional<Tensor>& position_ids, int64_t rotary_dim, double base,
                       bool interleaved, bool conjugate, const char* op) {
  check_rotary(x, cos, sin, offset, offsets, position_ids, rotary_dim, base, op);
  if (x.numel() == 0) return;
  const bool has_table = cos.has_value() && cos->defined();
  cpu::RotaryParams p{x.data_ptr(),
                      out.data_ptr(),
                      x.size(0),
                      x.size(1),
                      x.size(2),
                      x.size(3),
                      rotary_dim,
                      x.stride(0),
                      x.stride(1),
                      x.stride(2),
                      out.stride(0),
                      out.stride(1),
                      out.stride(2),
                      has_table ? cos->data_ptr() : nullptr,
                      has_table ? sin->data_ptr() : nullptr,
                      has_table ? cos->stride(0) : 0,
                      base,
                      offset,
                      optional_ptr(offsets),
                      optional_ptr(position_ids),
                      interleaved,
                      conjugate,
                      !out.is_same(x)};
  FASTATTN_DISPATCH_FLOATS(x.scalar_type(), "positional",
                           [&] { FASTATTN_CPU_ISA_CALL(apply_rotary<scalar_t>, p); });
}

void apply_rotary_inplace_cpu(const Tensor& x, const optional<Tensor>& cos,
                              const optional<Tensor>& sin, int64_t offset,
                              const optional<Tensor>& offsets, const optional<Tensor>& position_ids,
                              int64_t rotary_dim, double base, bool interleaved, bool conjugate) {
  apply_rotary_into(x, x, cos, sin, offset, offsets, position_ids, rotary_dim, base, interleaved,
                    conjugate, "apply_rotary_");
}

}  // namespace

Tensor apply_rotary_cpu(const Tensor& x, const std::optional<Tensor>& cos,
                        const std::optional<Tensor>& sin, int64_t offset,
                        const std::optional<Tensor>& offsets,
                        const std::optional<Tensor>& position_ids, int64_t rotary_dim, double base,
                        bool interleaved, bool conjugate) {
  Tensor out = empty_like(x);
  cpu::advise_huge_pages(out);
  poison(out);
  apply_rotary_into(x, out, cos, sin, offset, offsets, position_ids, rotary_dim, base, interleaved,
                    conjugate, "apply_rotary");
  return out;
}

STABLE_TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("sinusoidal_table", TORCH_BOX(&sinusoidal_table_cpu));
  m.impl("add_sinusoidal", TORCH_BOX(&add_sinusoidal_cpu));
  m.impl("add_sinusoidal_", TORCH_BOX(&add_sinusoidal_inplace_cpu));
  m.impl("add_sinusoidal_backward", TORCH_BOX(&add_sinusoidal_backward_cpu));
  m.impl("embed_with_positions", TORCH_BOX(&embed_with_positions_cpu));
  m.impl("embed_with_positions_backward", TORCH_BOX(&embed_with_positions_backward_cpu));
  m.impl("apply_rotary", TORCH_BOX(&apply_rotary_cpu));
  m.impl("apply_rotary_", TORCH_BOX(&apply_rotary_inplace_cpu));
}

}  // namespace fastattn::positional
