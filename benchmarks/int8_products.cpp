// How fast can an AVX2 core multiply int8 weights by int8 activations, and is the product's
// widening (vpmaddwd by ones, on the same multiply pipe as vpmaddubsw on AMD Zen 1) or a float
// path on the other FMA pipe worth trading? Data sits in L1: this is the cores' ceiling, not memory.
//
//   g++ -O2 -mavx2 -mfma -o /tmp/int8_products benchmarks/int8_products.cpp && /tmp/int8_products
//
// Variants, each NT = 2 tokens on one row of K weights (an expert's ~2 tokens at 8 streams):
//   madd:   |w| * sign(a, w) with vpmaddubsw, widened by vpmaddwd(ones): what moe_cpu.cpp runs
//   mixed:  every other block widened by shifts (vpslld/vpsrad) in place of vpmaddwd
//   shifts: every block widened by shifts
//   float:  a third of the weights converted to float and multiplied by FMAs (8 accumulators)
// Prints GMAC/s per variant, three rounds. Results are in benchmarks/RESULTS.md (round twenty).
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

constexpr int K = 3072, NT = 2, REPS = 12000;
alignas(64) int8_t W[K];
alignas(64) int8_t A[NT][K];
alignas(64) float X[NT][K];

static inline __m256i product(__m256i w, __m256i a) {
  return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

static inline __m256i widen_shifts(__m256i p) {
  return _mm256_add_epi32(_mm256_srai_epi32(p, 16), _mm256_srai_epi32(_mm256_slli_epi32(p, 16), 16));
}

template <int MODE>  // 0 madd, 1 mixed, 2 shifts
__attribute__((noinline)) int64_t integer(void) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_si256();
  for (int r = 0; r < REPS; ++r)
    for (int k = 0; k < K; k += 64) {
      const __m256i w0 = _mm256_load_si256((const __m256i*)(W + k)), w1 = _mm256_load_si256((const __m256i*)(W + k + 32));
      for (int t = 0; t < NT; ++t) {
        const __m256i p0 = product(w0, _mm256_load_si256((const __m256i*)(A[t] + k)));
        const __m256i p1 = product(w1, _mm256_load_si256((const __m256i*)(A[t] + k + 32)));
        acc[t] = _mm256_add_epi32(acc[t], MODE == 2 ? widen_shifts(p0) : _mm256_madd_epi16(p0, ones));
        acc[t] = _mm256_add_epi32(acc[t], MODE == 0 ? _mm256_madd_epi16(p1, ones) : widen_shifts(p1));
      }
    }
  int64_t s = 0;
  for (int t = 0; t < NT; ++t) {
    alignas(32) int32_t v[8];
    _mm256_store_si256((__m256i*)v, acc[t]);
    for (int i = 0; i < 8; ++i) s += v[i];
  }
  return s;
}

__attribute__((noinline)) int64_t with_float(void) {  // 64 weights of 96 on the integer path, 32 as floats
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[NT];
  __m256 facc[NT][4];
  for (int t = 0; t < NT; ++t) {
    acc[t] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) facc[t][j] = _mm256_setzero_ps();
  }
  for (int r = 0; r < REPS; ++r)
    for (int k = 0; k + 96 <= K; k += 96) {
      const __m256i w0 = _mm256_load_si256((const __m256i*)(W + k)), w1 = _mm256_load_si256((const __m256i*)(W + k + 32));
      __m256 f[4];
      for (int j = 0; j < 4; ++j)
        f[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(W + k + 64 + 8 * j))));
      for (int t = 0; t < NT; ++t) {
        acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(product(w0, _mm256_load_si256((const __m256i*)(A[t] + k))), ones));
        acc[t] = _mm256_add_epi32(acc[t],
                                  _mm256_madd_epi16(product(w1, _mm256_load_si256((const __m256i*)(A[t] + k + 32))), ones));
        for (int j = 0; j < 4; ++j) facc[t][j] = _mm256_fmadd_ps(f[j], _mm256_load_ps(X[t] + k + 64 + 8 * j), facc[t][j]);
      }
    }
  double s = 0;
  for (int t = 0; t < NT; ++t) {
    alignas(32) int32_t v[8];
    alignas(32) float fv[8];
    _mm256_store_si256((__m256i*)v, acc[t]);
    _mm256_store_ps(fv, _mm256_add_ps(_mm256_add_ps(facc[t][0], facc[t][1]), _mm256_add_ps(facc[t][2], facc[t][3])));
    for (int i = 0; i < 8; ++i) s += v[i] + fv[i];
  }
  return static_cast<int64_t>(s);
}

template <class F>
static void time_it(const char* name, F f) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t check = f();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%-7s %6.2f GMAC/s  (check %lld)\n", name, double(K) * NT * REPS / s / 1e9, (long long)check);
}

int main() {
  for (int k = 0; k < K; ++k) {
    W[k] = static_cast<int8_t>(std::rand() % 255 - 127);
    for (int t = 0; t < NT; ++t) X[t][k] = A[t][k] = static_cast<int8_t>(std::rand() % 255 - 127);
  }
  for (int round = 0; round < 3; ++round) {
    time_it("madd", integer<0>);
    time_it("mixed", integer<1>);
    time_it("shifts", integer<2>);
    time_it("float", with_float);
  }
}
