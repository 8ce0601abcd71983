// How many weight streams a thread needs to reach this machine's read bandwidth.
//
// A batch-1 GEMV (y = W x, W [N, K] f32, row-major) split over the threads as the expert and
// dense kernels split it: each thread owns a contiguous range of rows. With S streams, a thread
// walks S equal parts of its range in lockstep (row i of each part), so S runs of pages are open
// at once; S = 1 is the plain walk in address order. Optionally each stream is prefetched 1 KiB
// ahead. Rows of 1 KiB behave like int8 rows of K = 1024; rows of 4 KiB like float32 ones.
//
//     g++ -O3 -march=native -fopenmp benchmarks/read_streams.cpp -o /tmp/read_streams
//     OMP_NUM_THREADS=2 /tmp/read_streams [row_bytes=1024] [MiB=768]
//
// Prints GB/s of weights read (best of 5 passes over the working set, which is sized well past
// the last-level cache). GCC vector extensions: the same source builds for AVX2 and AVX-512.
// With AVX-512 it also reads each 64 bytes in two 256-bit loads (as the kernels' V::load_w),
// which on Zen 4 streamed faster than one 512-bit load.
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

typedef float vec __attribute__((vector_size(64)));  // 16 floats: one zmm, two ymm
constexpr int kLanes = 16;

// 64 bytes of weights at p: one vector load, or (Split) two 256-bit halves.
template <bool Split>
static inline vec load_w(const float* p) {
#ifdef __AVX512F__
  if (Split) {
    const __m256d lo = _mm256_loadu_pd(reinterpret_cast<const double*>(p));
    const __m256d hi = _mm256_loadu_pd(reinterpret_cast<const double*>(p + 8));
    return (vec)_mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1));
  }
#endif
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int S, bool Prefetch, bool Split = false>
static void gemv(const float* w, const float* x, float* y, long N, long K) {
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const long n0 = N * t / nt, n1 = N * (t + 1) / nt, part = (n1 - n0) / S;
    for (long i = 0; i < part; ++i) {
      vec acc[S];
      for (int s = 0; s < S; ++s) acc[s] = vec{};
      for (long k = 0; k < K; k += kLanes) {
        vec xv;
        std::memcpy(&xv, x + k, sizeof xv);
        for (int s = 0; s < S; ++s) {
          const float* row = w + (n0 + s * part + i) * K;
          if (Prefetch) __builtin_prefetch(reinterpret_cast<const char*>(row + k) + 1024);
          acc[s] += load_w<Split>(row + k) * xv;
        }
      }
      for (int s = 0; s < S; ++s) {
        float sum = 0.f;
        for (int j = 0; j < kLanes; ++j) sum += acc[s][j];
        y[n0 + s * part + i] = sum;
      }
    }
  }
}

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  const long row_bytes = argc > 1 ? atol(argv[1]) : 1024, mib = argc > 2 ? atol(argv[2]) : 768;
  if (row_bytes < 64 || row_bytes % 64 || mib < 64) {
    fprintf(stderr, "usage: read_streams [row_bytes: a multiple of 64] [MiB >= 64]\n");
    return 2;
  }
  const long K = row_bytes / 4, matrix = 16L << 20, N = matrix / row_bytes, copies = mib / 16;
  std::vector<float*> ws;
  for (long c = 0; c < copies; ++c) {
    float* p = static_cast<float*>(aligned_alloc(64, matrix));
#pragma omp parallel for
    for (long i = 0; i < N * K; ++i) p[i] = 0.001f * static_cast<float>(i % 7);
    ws.push_back(p);
  }
  std::vector<float> x(K, 1.f), y(N);
  auto run = [&](const char* name, void (*fn)(const float*, const float*, float*, long, long)) {
    double best = 0;
    for (int pass = 0; pass < 6; ++pass) {  // the first pass warms up
      const double start = now();
      for (long c = 0; c < copies; ++c) fn(ws[c], x.data(), y.data(), N, K);
      const double gbs = copies * static_cast<double>(matrix) / (now() - start) / 1e9;
      if (pass > 0 && gbs > best) best = gbs;
    }
    printf("%-28s %6.1f GB/s\n", name, best);
  };
  printf("rows of %ld bytes, %ld MiB, %d threads\n", row_bytes, copies * 16, omp_get_max_threads());
  run("1 stream per thread", gemv<1, false>);
  run("2 streams", gemv<2, false>);
  run("4 streams", gemv<4, false>);
  run("8 streams", gemv<8, false>);
  run("1 stream, prefetched", gemv<1, true>);
  run("4 streams, prefetched", gemv<4, true>);
#ifdef __AVX512F__
  run("1 stream, 256-bit loads", gemv<1, false, true>);
  run("4 streams, 256-bit loads", gemv<4, false, true>);
#endif
  return 0;
}
