// y = x @ w.T for w in 4-bit blocks of 32 inputs (w = v * scale + low per block, v in 0..15) and
// x quantized on the fly to int8 per block of 32 (x ~ dx * qx), as llama.cpp multiplies its
// Q4 files: y[m, n] = sum_b scale[n, b] * dx[m, b] * (v[n, b] . qx[m, b]) + low[n, b] * dx[m, b] * sum(qx[m, b]).
// Scale and low are float16, as a GGUF file stores them.
//
// The integer dot products run 32 lanes of u8 x s8 at a time (AVX2's maddubs, or one AVX-VNNI
// dpbusd where the CPU has it); sum(x[m, b]) is the sum of the quantized values, so y is exactly
// the product of the quantized x (up to float32 rounding). Every output depends on its
// own row of x only, in an order fixed by the inputs, so a row's result does not depend on how
// many rows share the call (a prompt gives the same values however the scheduler chunks it).
//
// Registered as torch.ops.shardwise_blocks.mm(x, v, scale, low, fine): x float32 or bfloat16 [M, K],
// the weights in block_dot.py pack()'s layout (see "the product" below), y float32 [M, N]. fine:
// each activation as two int8 levels (14 bits; two dot products), else one (llama.cpp's Q8).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

constexpr int64_t QK = 32;    // values per block

// ---- activations: float -> int8 per block of 32, with the block's scale and exact sum ----------

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <typename T>
__attribute__((target("avx2,fma"))) inline __m256 load8(const T* p);

template <>
__attribute__((target("avx2,fma"))) inline __m256 load8<float>(const float* p) {
  return _mm256_loadu_ps(p);
}

template <>
__attribute__((target("avx2,fma"))) inline __m256 load8<c10::BFloat16>(const c10::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,fma"))) inline void store_int8(__m256 a, __m256 b, __m256 c, __m256 d, int8_t* q) {
  const int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  // pack 32 int32 -> 32 int8; the packs interleave 128-bit lanes, the permute restores the order
  const __m256i i16a = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_round_ps(a, r)), _mm256_cvtps_epi32(_mm256_round_ps(b, r)));
  const __m256i i16b = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_round_ps(c, r)), _mm256_cvtps_epi32(_mm256_round_ps(d, r)));
  const __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16a, i16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), i8);
}

// One row of x: per block, q1 = round(x / d) with d = max|x| / 127 (x ~ d * q1) and, where fine,
// q2 = round((x / d - q1) * 128) in -64..64, so that x ~ d / 128 * (128 q1 + q2): 14 bits per value
// (an error of at most max|x| / 32512), a bfloat16's precision or better. s: the sum of the block's
// quantized values, so that the product is exactly that of the quantized x.
template <typename T>
__attribute__((target("avx2,fma"))) void quantize_row(const T* x, int64_t K, int8_t* q1, int8_t* q2, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t b = 0; b < K / QK; ++b) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x + b * QK + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float m = hmax(amax);
    d[b] = m / 127.0f;
    const __m256 inv = _mm256_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
    __m256 u[4], sum = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) u[i] = _mm256_mul_ps(v[i], inv);
    store_int8(u[0], u[1], u[2], u[3], q1 + b * QK);
    if (q2 != nullptr) {
      const __m256 k = _mm256_set1_ps(128.0f);
      __m256 f[4];
      for (int i = 0; i < 4; ++i) {
        const __m256 whole = _mm256_round_ps(u[i], r);
        f[i] = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(u[i], whole), k), r);
        sum = _mm256_add_ps(sum, _mm256_fmadd_ps(whole, k, f[i]));      // 128 q1 + q2, exact
      }
      store_int8(f[0], f[1], f[2], f[3], q2 + b * QK);
      s[b] = hsum(sum) * (d[b] / 128.0f);
    } else {
      for (int i = 0; i < 4; ++i) sum = _mm256_add_ps(sum, _mm256_round_ps(u[i], r));
      s[b] = hsum(sum) * d[b];
    }
  }
}

// ---- the product -------------------------------------------------------------------------------
//
// Weights are packed per tile of 8 rows and block of 32 inputs (128 bytes): 4 chunks of 32 bytes,
// chunk c holding, for each row r of the tile, the 4 values of inputs [4c, 4c + 4) in the low
// nibbles and of inputs [4c + 16, 4c + 20) in the high nibbles, at bytes [4r, 4r + 4). One 256-bit
// register of such a chunk multiplies one broadcast group of 4 activations into 8 int32 lanes, one
// per row, so a block's integer sums land one lane per row and its scales apply as a vector of 8:
// no horizontal sums, and each unpacked block is reused by up to 4 activation rows.

constexpr int64_t TILE = 8;   // weight rows per tile: the int32 lanes of a 256-bit register
constexpr int64_t MT = 4;     // activation rows per pass over a tile's blocks

struct Args {
  const uint8_t* v;      // [N / 8, B, 4, 8, 4]
  const uint16_t* scale; // [N / 8, B, 8] float16
  const uint16_t* low;   // [N / 8, B, 8] float16
  const int8_t* q;       // [M, K]
  const int8_t* q2;      // [M, K], fine only
  const float* dx;       // [M, B]
  const float* sx;       // [M, B]
  float* y;              // [M, N]
  int64_t M, N, K;
};

#define SHARDWISE_BLOCK_DOT_VARIANT(NAME, TARGET, DOT)                                              \
  /* one block of 8 rows (w: its 8 groups of 4 inputs) times one block of x, into 8 int32 lanes */  \
  __attribute__((target(TARGET), always_inline)) inline __m256i NAME##_dots(const __m256i* w, const int8_t* x) { \
    __m256i sum = _mm256_setzero_si256();                                                           \
    for (int g = 0; g < 8; ++g) {                                                                   \
      int32_t four;                                                                                 \
      __builtin_memcpy(&four, x + 4 * g, 4);                                                        \
      sum = DOT(sum, w[g], _mm256_set1_epi32(four));                                                \
    }                                                                                               \
    return sum;                                                                                     \
  }                                                                                                 \
  template <int R, bool FINE>                                                                       \
  __attribute__((target(TARGET))) void NAME##_tile(const Args& a, int64_t t, int64_t m0) {          \
    const int64_t B = a.K / QK;                                                                     \
    const __m256i nib = _mm256_set1_epi8(15);                                                       \
    __m256 acc[R];                                                                                  \
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();                                       \
    for (int64_t b = 0; b < B; ++b) {                                                               \
      const uint8_t* p = a.v + (t * B + b) * (TILE * QK / 2);                                       \
      __m256i w[8];                                                                                 \
      for (int c = 0; c < 4; ++c) {                                                                 \
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * c));     \
        w[c] = _mm256_and_si256(bytes, nib);                                                        \
        w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nib);                              \
      }                                                                                             \
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.scale + (t * B + b) * TILE))); \
      const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.low + (t * B + b) * TILE)));     \
      for (int i = 0; i < R; ++i) {                                                                 \
        __m256i sum = NAME##_dots(w, a.q + (m0 + i) * a.K + b * QK);                                \
        const int64_t mb = (m0 + i) * B + b;                                                        \
        float dx = a.dx[mb];                                                                        \
        if constexpr (FINE) {                                                                       \
          const __m256i fine = NAME##_dots(w, a.q2 + (m0 + i) * a.K + b * QK);                      \
          sum = _mm256_add_epi32(_mm256_slli_epi32(sum, 7), fine);                                  \
          dx *= 1.0f / 128.0f;                                                                      \
        }                                                                                           \
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, _mm256_set1_ps(dx)), acc[i]); \
        acc[i] = _mm256_fmadd_ps(low, _mm256_set1_ps(a.sx[mb]), acc[i]);                            \
      }                                                                                             \
    }                                                                                               \
    for (int i = 0; i < R; ++i) _mm256_storeu_ps(a.y + (m0 + i) * a.N + t * TILE, acc[i]);          \
  }                                                                                                 \
  template <bool FINE>                                                                              \
  __attribute__((target(TARGET))) void NAME##_rows(const Args& a, int64_t t0, int64_t t1) {         \
    for (int64_t t = t0; t < t1; ++t) {                                                             \
      int64_t m = 0;                                                                                \
      for (; m + MT <= a.M; m += MT) NAME##_tile<MT, FINE>(a, t, m);                                \
      for (; m < a.M; ++m) NAME##_tile<1, FINE>(a, t, m);                                           \
    }                                                                                               \
  }

// u8 x s8 in groups of 4 into int32 lanes: AVX2 (two instructions), AVX-VNNI, AVX512-VNNI (VL)
__attribute__((target("avx2,fma"))) inline __m256i dot_avx2(__m256i acc, __m256i w, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
__attribute__((target("avx2,fma,f16c,avxvnni"))) inline __m256i dot_avxvnni(__m256i acc, __m256i w, __m256i x) {
  return _mm256_dpbusd_avx_epi32(acc, w, x);
}
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni"))) inline __m256i dot_avx512vnni(__m256i acc, __m256i w, __m256i x) {
  return _mm256_dpbusd_epi32(acc, w, x);
}

SHARDWISE_BLOCK_DOT_VARIANT(avx2, "avx2,fma,f16c", dot_avx2)
SHARDWISE_BLOCK_DOT_VARIANT(avxvnni, "avx2,fma,f16c,avxvnni", dot_avxvnni)
SHARDWISE_BLOCK_DOT_VARIANT(avx512vnni, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni", dot_avx512vnni)

// Two tiles (16 rows) at once in 512-bit registers, where the CPU has AVX512-VNNI: the same dot
// products as above with half the instructions per value (broadcasts, conversions and scalings are
// shared by 16 rows instead of 8).
#define SHARDWISE_ZMM "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"

// one block of 16 rows times one block of x, into 16 int32 lanes
__attribute__((target(SHARDWISE_ZMM), always_inline)) inline __m512i zmm_dots(const __m512i* w, const int8_t* x) {
  __m512i sum = _mm512_setzero_si512();
  for (int g = 0; g < 8; ++g) {
    int32_t four;
    __builtin_memcpy(&four, x + 4 * g, 4);
    sum = _mm512_dpbusd_epi32(sum, w[g], _mm512_set1_epi32(four));
  }
  return sum;
}

// 8 float16 numbers from each of two tiles -> 16 floats
__attribute__((target(SHARDWISE_ZMM))) inline __m512 halves(const uint16_t* lo, const uint16_t* hi) {
  return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)),
                                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))));
}

template <int R, bool FINE>
__attribute__((target(SHARDWISE_ZMM))) void zmm_pair(const Args& a, int64_t t, int64_t m0) {
  const int64_t B = a.K / QK;
  const __m512i nib = _mm512_set1_epi8(15);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* p0 = a.v + (t * B + b) * (TILE * QK / 2);
    const uint8_t* p1 = a.v + ((t + 1) * B + b) * (TILE * QK / 2);
    __m512i w[8];
    for (int c = 0; c < 4; ++c) {
      const __m512i bytes = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0 + 32 * c))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + 32 * c)), 1);
      w[c] = _mm512_and_si512(bytes, nib);
      w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nib);
    }
    const __m512 scale = halves(a.scale + (t * B + b) * TILE, a.scale + ((t + 1) * B + b) * TILE);
    const __m512 low = halves(a.low + (t * B + b) * TILE, a.low + ((t + 1) * B + b) * TILE);
    for (int i = 0; i < R; ++i) {
      __m512i sum = zmm_dots(w, a.q + (m0 + i) * a.K + b * QK);
      const int64_t mb = (m0 + i) * B + b;
      float dx = a.dx[mb];
      if constexpr (FINE) {
        sum = _mm512_add_epi32(_mm512_slli_epi32(sum, 7), zmm_dots(w, a.q2 + (m0 + i) * a.K + b * QK));
        dx *= 1.0f / 128.0f;
      }
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(dx)), acc[i]);
      acc[i] = _mm512_fmadd_ps(low, _mm512_set1_ps(a.sx[mb]), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(a.y + (m0 + i) * a.N + t * TILE, acc[i]);
}

template <bool FINE>
__attribute__((target(SHARDWISE_ZMM))) void zmm_rows(const Args& a, int64_t t0, int64_t t1) {
  int64_t t = t0;
  for (; t + 2 <= t1; t += 2) {
    int64_t m = 0;
    for (; m + MT <= a.M; m += MT) zmm_pair<MT, FINE>(a, t, m);
    for (; m < a.M; ++m) zmm_pair<1, FINE>(a, t, m);
  }
  if (t < t1) avx512vnni_rows<FINE>(a, t, t1);      // an odd tile left: 8 rows in 256-bit registers
}

using RowsFn = void (*)(const Args&, int64_t, int64_t);

template <bool FINE>
RowsFn pick() {
  // SHARDWISE_BLOCK_DOT_256=1 keeps to 256-bit registers (a CPU that slows down for 512-bit ones)
  const char* only256 = std::getenv("SHARDWISE_BLOCK_DOT_256");
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
      !(only256 != nullptr && std::string(only256) == "1"))
    return zmm_rows<FINE>;
  if (__builtin_cpu_supports("avxvnni")) return avxvnni_rows<FINE>;
  return avx2_rows<FINE>;
}

at::Tensor mm(const at::Tensor& x, const at::Tensor& v, const at::Tensor& scale, const at::Tensor& low, bool fine) {
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"),
              "the block-dot kernel needs AVX2, FMA and F16C");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "x: a contiguous CPU matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), B = K / QK;
  TORCH_CHECK(K % QK == 0, "inputs: a multiple of 32");
  TORCH_CHECK(v.scalar_type() == at::kByte && v.is_contiguous() && v.dim() == 5 && v.size(1) == B &&
                  v.size(2) == 4 && v.size(3) == TILE && v.size(4) == 4,
              "v: uint8 [N / 8, K / 32, 4, 8, 4]");
  const int64_t N = v.size(0) * TILE;
  for (const at::Tensor* t : {&scale, &low})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() &&
                    t->sizes() == at::IntArrayRef({N / TILE, B, TILE}),
                "scale, low: float16 [N / 8, K / 32, 8]");
  std::vector<int8_t> q(M * K), q2(fine ? M * K : 0);
  std::vector<float> dx(M * B), sx(M * B);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (x.scalar_type() == at::kFloat)
        quantize_row(x.data_ptr<float>() + m * K, K, q.data() + m * K, fine ? q2.data() + m * K : nullptr, dx.data() + m * B, sx.data() + m * B);
      else
        quantize_row(x.data_ptr<c10::BFloat16>() + m * K, K, q.data() + m * K, fine ? q2.data() + m * K : nullptr, dx.data() + m * B, sx.data() + m * B);
    }
  });
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const Args a{v.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>()),
               reinterpret_cast<const uint16_t*>(low.data_ptr<at::Half>()), q.data(), q2.data(), dx.data(), sx.data(),
               y.data_ptr<float>(), M, N, K};
  static const RowsFn coarse = pick<false>(), finer = pick<true>();
  const RowsFn rows = fine ? finer : coarse;
  // split in pairs of tiles (the 512-bit kernel's unit); grain: enough that a thread's share
  // outweighs waking it
  const int64_t tiles = N / TILE;
  at::parallel_for(0, (tiles + 1) / 2, std::max<int64_t>(1, 16 / std::max<int64_t>(M, 1)),
                   [&](int64_t p0, int64_t p1) { rows(a, 2 * p0, std::min(2 * p1, tiles)); });
  return y;
}

}  // namespace

TORCH_LIBRARY(shardwise_blocks, m) {
  m.def("mm(Tensor x, Tensor v, Tensor scale, Tensor low, bool fine) -> Tensor", &mm);
}
