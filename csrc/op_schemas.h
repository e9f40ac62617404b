// Every fastattn op schema, declared once, one function per op (csrc/<op>). bindings.cpp
// declares them all as the library "fastattn"; a second consumer of the schemas (the CUDA
// emulator of tools/cuda_emu registers the CUDA op bodies compiled for the CPU as the library
// "fastattn_emu") calls the same functions, so the two can never drift apart. Library: the
// stable API's library (bindings.cpp) or torch::Library (the emulator); both take schema strings.
#pragma once

namespace fastattn::schemas {

template <class Library>
void define_attention(Library& m) {
  // Softmax attention (csrc/attention). Canonical arguments and contract:
  // fastattn/contracts/attention.py. attn_mask is 4-D and broadcasts to (B, Hq, Lq, Lk) (each
  // dim 1 or full). The backward's fourth output is d attn_mask, shaped like attn_mask (summed
  // over its broadcast dims), when mask_grad is set (a float mask); an empty tensor otherwise.
  m.def(
      "attention_forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, "
      "Tensor? key_padding_mask, Tensor? alibi_slopes, float scale, float softcap, "
      "int window_lo, int window_hi, float dropout_p, Tensor? seed) -> (Tensor, Tensor)");
  m.def(
      "attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, "
      "Tensor out, Tensor lse, Tensor? attn_mask, Tensor? key_padding_mask, "
      "Tensor? alibi_slopes, float scale, float softcap, int window_lo, int window_hi, "
      "float dropout_p, Tensor? seed, bool deterministic, bool mask_grad=False) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}

template <class Library>
void define_varlen_attention(Library& m) {
  // Packed variable-length attention (csrc/varlen_attention): q (total_q, Hq, D), k/v
  // (total_k, Hkv, D/Dv), cu_seqlens int32 (B+1,); causal_mode 0 off, 1 top-left,
  // 2 bottom-right; window_left/right -1 = unbounded; lse (Hq, total_q). max_seqlen is a
  // SymInt so that torch.compile(dynamic=True) does not specialize a graph on it.
  m.def(
      "varlen_attention_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? alibi_slopes, "
      "float scale, float softcap, int causal_mode, int window_left, int window_right, "
      "float dropout_p, Tensor? seed) -> (Tensor, Tensor)");
  m.def(
      "varlen_attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, "
      "Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? alibi_slopes, float scale, "
      "float softcap, int causal_mode, int window_left, int window_right, float dropout_p, "
      "Tensor? seed, bool deterministic) -> (Tensor, Tensor, Tensor)");
}

template <class Library>
void define_attention_with_kvcache(Library& m) {
  // Attention over a KV cache (csrc/attention_with_kvcache): q (B, Hq, Lq, D) at positions
  // q_positions[b] + i against keys [0, k_lengths[b]) of k_cache/v_cache (B, Hkv, Lmax, D/Dv),
  // split over num_splits key ranges merged at the end (flash-decoding). Inference only.
  // block_table int32 (B, max_blocks_per_seq): a paged cache, k_cache/v_cache pools
  // (num_blocks, Hkv, block_size, D/Dv); position p of sequence b is row p % block_size of block
  // block_table[b, p // block_size], read through the table inside the kernels.
  m.def(
      "attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_lengths, "
      "Tensor q_positions, Tensor? alibi_slopes, float scale, float softcap, int causal_mode, "
      "int window_left, int window_right, int num_splits, Tensor? block_table=None) "
      "-> (Tensor, Tensor)");
  // Decoding in one call: rotary on q and k_new (tables (Lmax, rotary_dim / 2) in the compute
  // dtype, positions cache_seqlens[b] + i), k_new/v_new appended into the caches in place at
  // cache_seqlens, then attention_decode over cache_seqlens + Lnew keys. Returns (out, lse).
  m.def(
      "attention_with_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor cache_seqlens, Tensor? k_new, Tensor? v_new, Tensor? rotary_cos, "
      "Tensor? rotary_sin, bool rotary_interleaved, Tensor? alibi_slopes, float scale, "
      "float softcap, int causal_mode, int window_left, int window_right, int num_splits, "
      "Tensor? block_table=None) -> (Tensor, Tensor)");
}

template <class Library>
void define_additive_attention(Library& m) {
  // Additive (Bahdanau) attention scores (csrc/additive_attention):
  // S[b, i, j] = sum_a v[a] tanh(qp[b, i, a] + kp[b, j, a]), in float (double for double).
  m.def("additive_scores(Tensor qp, Tensor kp, Tensor v) -> Tensor");
  m.def(
      "additive_scores_backward(Tensor grad, Tensor qp, Tensor kp, Tensor v) "
      "-> (Tensor, Tensor, Tensor)");
  // The masked softmax of those scores and the weighted sum of values, fused (CPU):
  // (context (B, Lq, Dv) in values' dtype, weights (B, Lq, Lk) in the scores' dtype).
  m.def(
      "additive_context(Tensor scores, Tensor values, Tensor? key_padding_mask) "
      "-> (Tensor, Tensor)");
  m.def(
      "additive_context_backward(Tensor grad_context, Tensor? grad_weights, Tensor weights, "
      "Tensor values) -> (Tensor, Tensor)");
}

template <class Library>
void define_positional(Library& m) {
  // Positional encodings (csrc/positional). Dropout ops take seed = int64 (2,) on the device.
  m.def("sinusoidal_table(Tensor positions, int dim, float base, ScalarType dtype) -> Tensor");
  m.def(
      "add_sinusoidal(Tensor x, int offset, Tensor? offsets, float scale, float base, "
      "float dropout_p, Tensor? seed) -> Tensor");
  m.def(
      "add_sinusoidal_(Tensor(a!) x, int offset, Tensor? offsets, float scale, float base, "
      "float dropout_p, Tensor? seed) -> ()");
  m.def(
      "add_sinusoidal_backward(Tensor grad, float scale, float dropout_p, Tensor? seed) "
      "-> Tensor");
  m.def(
      "embed_with_positions(Tensor tokens, Tensor weight, Tensor? table, int offset, "
      "Tensor? offsets, float scale, float base, float dropout_p, Tensor? seed, int padding_idx, "
      "bool deterministic) -> Tensor");
  m.def(
      "embed_with_positions_backward(Tensor grad, Tensor tokens, int num_weights, "
      "int padding_idx, int table_rows, int offset, Tensor? offsets, float scale, "
      "float dropout_p, Tensor? seed, bool deterministic) -> (Tensor, Tensor)");
  m.def(
      "apply_rotary(Tensor x, Tensor? cos, Tensor? sin, int offset, Tensor? offsets, "
      "Tensor? position_ids, int rotary_dim, float base, bool interleaved, bool conjugate) "
      "-> Tensor");
  m.def(
      "apply_rotary_(Tensor(a!) x, Tensor? cos, Tensor? sin, int offset, Tensor? offsets, "
      "Tensor? position_ids, int rotary_dim, float base, bool interleaved, bool conjugate) "
      "-> ()");
}

template <class Library>
void define_lstm(Library& m) {
  // LSTM (csrc/lstm, on the engine of csrc/recurrent). The op contract (shapes, workspace, gate
  // order) is documented at the top of fastattn/contracts/lstm.py. Dropout ops take seed = int64
  // (2,) on the device.
  m.def(
      "lstm_cell(Tensor input, Tensor hx, Tensor cx, Tensor w_ih, Tensor w_hh, Tensor? b_ih, "
      "Tensor? b_hh) -> (Tensor, Tensor, Tensor)");
  m.def(
      "lstm_cell_backward(Tensor? grad_hy, Tensor? grad_cy, Tensor input, Tensor hx, "
      "Tensor cx, Tensor w_ih, Tensor w_hh, Tensor workspace, bool has_bias) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "lstm_layer(Tensor input, Tensor h0, Tensor c0, Tensor w_ih, Tensor w_hh, Tensor? b_ih, "
      "Tensor? b_hh, Tensor? w_hr, Tensor? lengths, float dropout_p, Tensor? seed, "
      "bool save_workspace) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "lstm_layer_backward(Tensor? grad_output, Tensor? grad_h_n, Tensor? grad_c_n, "
      "Tensor input, Tensor h0, Tensor c0, Tensor w_ih, Tensor w_hh, Tensor? w_hr, "
      "Tensor? lengths, Tensor workspace, float dropout_p, Tensor? seed, bool has_bias, "
      "bool input_grad, bool weight_grad) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // CUDA backend only: which recurrent path lstm_layer (lstm_layer_backward with backward=True)
  // takes for these arguments (0 = the persistent cooperative kernel, 1 = per step);
  // fastattn.ops.lstm.cuda_recurrent_path.
  m.def("lstm_cuda_path(Tensor input, Tensor w_hh, Tensor? w_hr, bool backward=False) -> int");
}

// GRU and Elman RNN layers (csrc/gru, csrc/rnn on the engine of csrc/recurrent). The op contract is
// documented at the top of fastattn/ops/_recurrent.py.
template <class Library>
void define_gru_rnn(Library& m) {
  m.def(
      "gru_layer(Tensor input, Tensor h0, Tensor w_ih, Tensor w_hh, Tensor? b_ih, "
      "Tensor? b_hh, Tensor? lengths, float dropout_p, Tensor? seed, bool reset_after, "
      "bool save_workspace) -> (Tensor, Tensor, Tensor)");
  m.def(
      "gru_layer_backward(Tensor? grad_output, Tensor? grad_h_n, Tensor input, Tensor h0, "
      "Tensor w_ih, Tensor w_hh, Tensor? lengths, Tensor workspace, float dropout_p, "
      "Tensor? seed, bool reset_after, bool has_bias, bool input_grad, bool weight_grad) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "rnn_layer(Tensor input, Tensor h0, Tensor w_ih, Tensor w_hh, Tensor? b_ih, "
      "Tensor? b_hh, Tensor? lengths, float dropout_p, Tensor? seed, str nonlinearity, "
      "bool save_workspace) -> (Tensor, Tensor, Tensor)");
  m.def(
      "rnn_layer_backward(Tensor? grad_output, Tensor? grad_h_n, Tensor input, Tensor h0, "
      "Tensor w_ih, Tensor w_hh, Tensor? lengths, Tensor workspace, float dropout_p, "
      "Tensor? seed, str nonlinearity, bool has_bias, bool input_grad, bool weight_grad) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // CUDA backend only: the recurrent path gru_layer / rnn_layer (their backward with
  // backward=True) take, as lstm_cuda_path; cell "gru" (reset after), "gru_reset_before",
  // "rnn_tanh" or "rnn_relu". fastattn.ops.gru/rnn.cuda_recurrent_path.
  m.def("recurrent_cuda_path(Tensor input, Tensor w_hh, str cell, bool backward=False) -> int");
}

template <class Library>
void define_all(Library& m) {
  define_attention(m);
  define_varlen_attention(m);
  define_attention_with_kvcache(m);
  define_additive_attention(m);
  define_positional(m);
  define_lstm(m);
  define_gru_rnn(m);
}

}  // namespace fastattn::schemas
