// The bfloat16 path of CPU attention (attention_bf16_cpu_kernel.cpp): declared in the copies
// compiled with AVX512-BF16, where attention_forward and attention_backward may take it.
#pragma once
#include "attention/attention_cpu_kernel.h"

#ifndef FASTATTN_ISA
#error "include this header from a kernel compiled through the per-ISA copies (CMakeLists.txt)"
#endif

#if defined(__AVX512BF16__)
namespace fastattn::cpu::FASTATTN_ISA {

// Whether the plain forward computes this call: no score pipeline, no paged cache.
bool plain_bf16_forward_fits(const AttentionProblem& p);
void plain_bf16_forward(const AttentionForwardParams& fp);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The same forward with its products on AMX tiles: where AMX is usable (cpu_amx.h) and the
// head dims are multiples of 32.
bool plain_amx_forward_fits(const AttentionProblem& p);
void plain_amx_forward(const AttentionForwardParams& fp);
#endif
// Whether the plain backward computes this call (plain_bf16_forward_fits' cases).
bool plain_bf16_backward_fits(const AttentionBackwardParams& bp);
void plain_bf16_backward(const AttentionBackwardParams& bp);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The same backward with its products on AMX tiles (plain_amx_forward_fits' AMX condition).
bool plain_amx_backward_fits(const AttentionBackwardParams& bp);
void plain_amx_backward(const AttentionBackwardParams& bp);
#endif

}  // namespace fastattn::cpu::FASTATTN_ISA
#endif
