// How fast this CPU reads a paged KV cache's blocks in random order, against the same blocks in
// pool order: the memory system's part of the paged/dense decode ratio (README, "Paged against
// dense"). No fastattn code: a pool laid out as PagedKVCache's,
// (num_blocks, Hkv, block_size, D) float32 for K and for V, B = 8 sequences of `len` keys,
// Hkv = 2, D = 64 (bench_decoding.paged_case's CPU shape); one task per sequence reads its
// blocks (both KV heads' rows, K then V) through a block table.
//
//   g++ -O2 -mavx512f -fopenmp benchmarks/paged_reads.cpp -o /tmp/paged_reads
//   /tmp/paged_reads 4096 16      # context, block rows
//
// A bare read (one vector add per 64-byte line, no prefetches), two threads, the two table
// orders alternating over 30 rounds of 5 passes; prints the median time of each and their ratio.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s context block_rows\n", argv[0]);
    return 2;
  }
  const int len = std::atoi(argv[1]), bs = std::atoi(argv[2]);
  constexpr int B = 8, H = 2, D = 64;
  if (bs <= 0 || bs % 16 != 0 || len <= 0 || len % bs != 0) {
    std::fprintf(stderr, "block rows: a positive multiple of 16 that divides the context\n");
    return 2;
  }
  const int per_seq = len / bs, blocks = B * per_seq;
  const size_t block_floats = size_t(H) * bs * D;
  std::vector<int> in_order(blocks), random(blocks);
  for (int i = 0; i < blocks; ++i) in_order[i] = random[i] = i;
  std::mt19937 gen(0);
  std::shuffle(random.begin(), random.end(), gen);
  auto* k_pool = static_cast<float*>(std::aligned_alloc(64, blocks * block_floats * 4));
  auto* v_pool = static_cast<float*>(std::aligned_alloc(64, blocks * block_floats * 4));
  for (size_t i = 0; i < blocks * block_floats; ++i) k_pool[i] = v_pool[i] = 1e-3f * (i % 7);
  omp_set_num_threads(2);
  float sink = 0;

  // Every block of every sequence, in the table's order: K's rows, then V's.
  auto run = [&](const std::vector<int>& table) {
    float total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int b = 0; b < B; ++b) {
      __m512 acc = _mm512_setzero_ps();
      for (int i = 0; i < per_seq; ++i) {
        const size_t at = size_t(table[b * per_seq + i]) * block_floats;
        for (const float* pool : {k_pool, v_pool}) {
          for (size_t e = 0; e < block_floats; e += 16) {
            acc = _mm512_add_ps(acc, _mm512_load_ps(pool + at + e));
          }
        }
      }
      total += _mm512_reduce_add_ps(acc);
    }
    sink += total;
  };

  std::vector<double> times[2];
  for (int round = 0; round < 30; ++round) {
    for (int order = 0; order < 2; ++order) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int rep = 0; rep < 5; ++rep) run(order ? random : in_order);
      times[order].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 5);
    }
  }
  for (auto& t : times) std::sort(t.begin(), t.end());
  const double bytes = 2.0 * blocks * block_floats * 4;
  const double t_order = times[0][15], t_random = times[1][15];
  std::printf(
      "context %d, %d-row blocks: in order %.0f us (%.1f GB/s), random %.0f us (%.1f GB/s), "
      "in order / random %.3f  [%g]\n",
      len, bs, t_order * 1e6, bytes / t_order / 1e9, t_random * 1e6,
      bytes / t_random / 1e9, t_order / t_random, static_cast<double>(sink > 0));
  return 0;
}
