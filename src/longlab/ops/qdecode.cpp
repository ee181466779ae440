// Fused decode attention over longlab's quantized KV layout, and paged sparse decode (CPU, float32 math),
// for longlab.ops.qdecode.
//
// quant_decode: one decode query per row (q [B, H, D]) against a QuantizedLayer's slots
//   [ sink (fp) | main (packed codes) | residual (fp) ]   (keys and values have their own main length),
// reading the packed codes and their scales in place: no dequantised copy of the cache. Scales fold into
// the query (keys) and into the probabilities (values):
//   per-channel keys (group gi of G tokens):  q.k_t = sum_c (q_c s_gi,c) code_t,c + sum_c q_c o_gi,c
//   per-token keys (groups r of G channels):  q.k_t = sum_r s_t,r sum_{c in r} (q_c l_c) code_t,c
//                                                     + sum_r o_t,r sum_{c in r} q_c l_c     (l: smoothing)
//   per-token values:  sum_t p_t v_t,c = sum_t (p_t s_t,r(c)) code_t,c + sum_t p_t o_t,r(c)
// and an online softmax (m' = max(m, max s), l' = l e^(m-m') + sum e^(s-m'), acc' = acc e^(m-m') + ...).
// Work is split over (b, kv head, slot range) units run by at::parallel_for; partial (m, l, acc) of the
// ranges of one (b, kv head) are merged by log-sum-exp at the end (flash-decoding).
//
// quantize_tokens_packed: per-token group quantization + planar packing, bit-identical to
// longlab.quant.quantizer (quantize_tokens, then pack): how a KIVI value enters the store at a decode step.
//
// paged_decode: each query head attends over its own list of slots (Quest's selected pages plus the last
// page; RetroAttention's loaded pages), reading those K/V rows in place (fp32), online softmax; returns
// the output and the log-sum-exp.
//
// Codes are planar-packed (longlab.quant.quantizer.pack): with per = 8 / bits codes per byte and
// P = D / per bytes per row, byte j holds codes j, j + P, ... at bit offsets 0, bits, ...; 16-bit codes are
// a plane of low bytes then a plane of high bytes.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16-math.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float NINF = -std::numeric_limits<float>::infinity();
constexpr int64_t TILE = 64;  // slots per online-softmax step
constexpr int64_t PREFETCH_TILES = 2;  // software prefetch distance (tiles ahead)

// ---- element conversion --------------------------------------------------------------------------------
enum Dt { F32 = 0, F16 = 1, BF16 = 2 };

inline Dt dt_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return F32;
    case at::kHalf: return F16;
    case at::kBFloat16: return BF16;
    default: TORCH_CHECK(false, "qdecode: float32/float16/bfloat16 expected, got ", t.scalar_type());
  }
  return F32;
}

inline int64_t esz(Dt dt) { return dt == F32 ? 4 : 2; }

inline float ld(const void* p, int64_t i, Dt dt) {
  switch (dt) {
    case F16: return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
    case BF16: return static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}

// n elements of p (dtype dt) -> out as float
inline void cvt_block(const void* p, int64_t n, Dt dt, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (dt == F16) {
    const uint16_t* h = static_cast<const uint16_t*>(p);
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  if (dt == F16) {
    const uint16_t* h = static_cast<const uint16_t*>(p);
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  }
#endif
  for (; i < n; ++i) out[i] = ld(p, i, dt);
}

// a row of D elements as float: the row itself (fp32) or converted into buf
inline const float* row_f32(const void* base, int64_t off, int64_t D, Dt dt, float* buf) {
  if (dt == F32) return static_cast<const float*>(base) + off;
  for (int64_t c = 0; c < D; ++c) buf[c] = ld(base, off + c, dt);
  return buf;
}

// ---- unpacking -----------------------------------------------------------------------------------------
#if defined(__AVX512F__)
inline void u8x16_to_f32(__m128i x, float* dst) { _mm512_storeu_ps(dst, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x))); }
#elif defined(__AVX2__)
inline void u8x16_to_f32(__m128i x, float* dst) {
  _mm256_storeu_ps(dst, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x)));
  _mm256_storeu_ps(dst + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(x, 8))));
}
#endif

// codes of one row (P packed bytes) -> dst[D] as float
inline void unpack_row(const uint8_t* src, int64_t D, int bits, float* dst) {
  if (bits == 16) {
    for (int64_t c = 0; c < D; ++c) dst[c] = static_cast<float>(src[c] | (src[D + c] << 8));
    return;
  }
  const int per = 8 / bits;
  const int64_t P = D / per;
  const unsigned mask = (1u << bits) - 1u;
  int64_t j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  const __m128i m = _mm_set1_epi8(static_cast<char>(mask));
  for (; j + 16 <= P; j += 16) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
    if (bits == 8) {
      u8x16_to_f32(x, dst + j);
      continue;
    }
    for (int i = 0; i < per; ++i) {  // field i: shift right by i*bits within each byte, then mask
      const __m128i f = _mm_and_si128(_mm_srli_epi16(x, i * bits), m);
      u8x16_to_f32(f, dst + i * P + j);
    }
  }
#endif
  for (; j < P; ++j) {
    const unsigned b = src[j];
    for (int i = 0; i < per; ++i) dst[i * P + j] = static_cast<float>((b >> (i * bits)) & mask);
  }
}

// ---- small vector helpers ------------------------------------------------------------------------------
inline float hsum(Vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#else
  alignas(64) float lanes[Vec::size()];
  v.store(lanes);
  float s = 0.0f;
  for (int l = 0; l < Vec::size(); ++l) s += lanes[l];
  return s;
#endif
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t c = 0;
  Vec acc(0.0f);
  for (; c + Vec::size() <= n; c += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + c), Vec::loadu(b + c), acc);
  float s = hsum(acc);
  for (; c < n; ++c) s += a[c] * b[c];
  return s;
}

inline void axpy(float w, const float* x, float* y, int64_t n) {  // y += w x
  int64_t c = 0;
  const Vec vw(w);
  for (; c + Vec::size() <= n; c += Vec::size()) at::vec::fmadd(vw, Vec::loadu(x + c), Vec::loadu(y + c)).store(y + c);
  for (; c < n; ++c) y[c] += w * x[c];
}

inline void mul(const float* a, const float* b, float* out, int64_t n) {  // out = a * b
  int64_t c = 0;
  for (; c + Vec::size() <= n; c += Vec::size()) (Vec::loadu(a + c) * Vec::loadu(b + c)).store(out + c);
  for (; c < n; ++c) out[c] = a[c] * b[c];
}

inline float row_max(const float* x, int64_t n) {
  int64_t c = 0;
  Vec vm(NINF);
  for (; c + Vec::size() <= n; c += Vec::size()) vm = at::vec::maximum(vm, Vec::loadu(x + c));
  alignas(64) float lanes[Vec::size()];
  vm.store(lanes);
  float m = NINF;
  for (int l = 0; l < Vec::size(); ++l) m = std::max(m, lanes[l]);
  for (; c < n; ++c) m = std::max(m, x[c]);
  return m;
}

// x <- exp(x - mx) over n floats (vectorised), returning their sum: one online-softmax step's weights
inline float exp_shift_sum(float* x, int64_t n, float mx) {
  int64_t i = 0;
  Vec vs(0.0f);
  const Vec vm(mx);
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec e = (Vec::loadu(x + i) - vm).exp_u20();
    e.store(x + i);
    vs = vs + e;
  }
  float sum = hsum(vs);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  return sum;
}

inline void scale(float a, float* y, int64_t n) {
  int64_t c = 0;
  const Vec va(a);
  for (; c + Vec::size() <= n; c += Vec::size()) (Vec::loadu(y + c) * va).store(y + c);
  for (; c < n; ++c) y[c] *= a;
}

// ---- a packed store --------------------------------------------------------------------------------------
struct Store {
  const uint8_t* codes = nullptr;  // [B, H_kv, n, P] contiguous rows
  const void* scale = nullptr;     // per-token: [B, H_kv, n, D/G]; per-channel: [B, H_kv, ceil(n/G), D]
  const void* offset = nullptr;
  const float* lam = nullptr;  // [H_kv, D] smoothing (per-token stores), or null
  Dt sdt = F16;
  int64_t n = 0, bits = 4, group = 32, row_bytes = 0, n_groups = 0;  // n_groups: scale rows (channel) or per row
  bool channel = false;
  int64_t cs_b = 0, cs_h = 0, ss_b = 0, ss_h = 0;  // strides (elements) of codes / scales over b, h

  void init(const at::Tensor& c, const at::Tensor& s, const at::Tensor& o, const c10::optional<at::Tensor>& l,
            int64_t bits_, int64_t group_, bool channel_, int64_t D) {
    // rows must be packed (a view of the first n rows of a larger buffer is fine); b, h strides are free
    TORCH_CHECK(c.scalar_type() == at::kByte && c.stride(3) == 1 && (c.size(2) <= 1 || c.stride(2) == c.size(3)),
                "qdecode: codes must be uint8 with packed rows");
    TORCH_CHECK(s.scalar_type() == o.scalar_type() && s.strides() == o.strides() && s.stride(3) == 1 &&
                    (s.size(2) <= 1 || s.stride(2) == s.size(3)),
                "qdecode: scale/offset must have packed rows, one dtype, the same strides");
    codes = c.data_ptr<uint8_t>();
    scale = s.data_ptr();
    offset = o.data_ptr();
    sdt = dt_of(s);
    n = c.size(2);
    bits = bits_;
    group = group_;
    channel = channel_;
    row_bytes = c.size(3);
    TORCH_CHECK(row_bytes == D * bits / 8, "qdecode: codes row of ", row_bytes, " bytes for D=", D, " at ", bits,
                " bits");
    cs_b = c.stride(0);
    cs_h = c.stride(1);
    ss_b = s.stride(0);
    ss_h = s.stride(1);
    n_groups = s.size(3);
    if (l.has_value() && l->defined()) {
      TORCH_CHECK(!channel && l->scalar_type() == at::kFloat && l->is_contiguous(), "qdecode: smoothing");
      lam = l->data_ptr<float>();
    }
  }
};

struct FpRegion {  // sink or residual: [B, H_kv, n, D] with a contiguous last dim
  const void* p = nullptr;
  Dt dt = F32;
  int64_t n = 0, sb = 0, sh = 0, st = 0;
  void init(const at::Tensor& t) {
    p = t.data_ptr();
    dt = dt_of(t);
    n = t.size(2);
    sb = t.stride(0);
    sh = t.stride(1);
    st = t.stride(2);
    TORCH_CHECK(n == 0 || t.stride(3) == 1, "qdecode: fp rows must have a contiguous last dim");
  }
};

// ---- codes of one row straight into NV float vectors (BITS known at compile time; 0: any width, via memory)
template <int BITS, int NV>
inline void unpack_vecs(const uint8_t* src, int bits, Vec (&x)[NV], float* tmp) {
  constexpr int L = Vec::size();
#if defined(__AVX512F__)
  constexpr int D = NV * L;
  if constexpr (BITS == 8) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v)
      x[v] = Vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + v * 16)))));
    return;
  } else if constexpr (BITS == 16) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + v * 16)));
      const __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + D + v * 16)));
      x[v] = Vec(_mm512_cvtepi32_ps(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 8))));
    }
    return;
  } else if constexpr (BITS == 2 || BITS == 4) {
    constexpr int per = 8 / BITS, P = D / per, chunks = P / 16;
    static_assert(P % 16 == 0, "whole 16-byte chunks");
    const __m128i m = _mm_set1_epi8(static_cast<char>((1 << BITS) - 1));
#pragma GCC unroll 16
    for (int jc = 0; jc < chunks; ++jc) {
      const __m128i xb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + jc * 16));
#pragma GCC unroll 8
      for (int i = 0; i < per; ++i) {
        const __m128i f = _mm_and_si128(_mm_srli_epi16(xb, i * BITS), m);
        x[i * chunks + jc] = Vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(f)));
      }
    }
    return;
  }
#elif defined(__AVX2__)
  constexpr int D = NV * L;  // L = 8 lanes
  auto widen = [](__m128i bytes8) {  // the low 8 bytes of bytes8 -> 8 floats
    return Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8)));
  };
  if constexpr (BITS == 8) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) x[v] = widen(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + v * 8)));
    return;
  } else if constexpr (BITS == 16) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + v * 8)));
      const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + D + v * 8)));
      x[v] = Vec(_mm256_cvtepi32_ps(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 8))));
    }
    return;
  } else if constexpr (BITS == 2 || BITS == 4) {
    constexpr int per = 8 / BITS, P = D / per, chunks = P / 16;
    static_assert(P % 16 == 0, "whole 16-byte chunks");
    const __m128i m = _mm_set1_epi8(static_cast<char>((1 << BITS) - 1));
#pragma GCC unroll 16
    for (int jc = 0; jc < chunks; ++jc) {
      const __m128i xb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + jc * 16));
#pragma GCC unroll 8
      for (int i = 0; i < per; ++i) {  // field i of bytes jc*16 .. +15: channels i*P + jc*16 .. +15
        const __m128i f = _mm_and_si128(_mm_srli_epi16(xb, i * BITS), m);
        x[(i * P + jc * 16) / 8] = widen(f);
        x[(i * P + jc * 16) / 8 + 1] = widen(_mm_srli_si128(f, 8));
      }
    }
    return;
  }
#endif
  unpack_row(src, NV * L, bits, tmp);
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) x[v] = Vec::loadu(tmp + v * L);
}

// ---- register-blocked runs of packed rows (D = NV vectors, GH query heads per KV head) ------------------
// scores of n consecutive packed key rows: sb[j * TILE + i] = bias_i,j + sum_v (qk_j . x_i) where per-token
// keys scale x by their group scale (ksc) and add the group offsets times the query sums (qsum).
#if defined(__AVX512F__)
// out lane i = the sum of the 16 lanes of r[i] (16 horizontal sums in 45 shuffles/adds, not 16 x 8)
inline __m512 reduce16(const __m512* r) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: [r_i lo+hi | r_(i+8) lo+hi] as 4 blocks of 4 partials
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[i], r[i + 8], 0x44), _mm512_shuffle_f32x4(r[i], r[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // blocks: r_i, r_(i+8), r_(i+4), r_(i+12) (4 partials each)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)  // within 128-bit blocks: 2 partials of b_i's and b_(i+2)'s token
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[i], b[i + 2], 0x44), _mm512_shuffle_ps(b[i], b[i + 2], 0xEE));
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  // lane 4k + p of d holds token [0, 2, 1, 3][p] + [0, 8, 4, 12][k]; put token i in lane i
  const __m512i perm = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(perm, d);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__)
// out lane i = the sum of the 8 lanes of r[i] (8 horizontal sums in 6 hadds, 2 permutes and an add)
inline __m256 reduce8(const __m256* r) {
  const __m256 h01 = _mm256_hadd_ps(r[0], r[1]), h23 = _mm256_hadd_ps(r[2], r[3]);
  const __m256 h45 = _mm256_hadd_ps(r[4], r[5]), h67 = _mm256_hadd_ps(r[6], r[7]);
  const __m256 a = _mm256_hadd_ps(h01, h23);  // [r0..r3 lanes 0-3 | r0..r3 lanes 4-7]
  const __m256 b = _mm256_hadd_ps(h45, h67);  // [r4..r7 lanes 0-3 | r4..r7 lanes 4-7]
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

// scores of n consecutive packed key rows: sb[j * TILE + i] = bias_j + qk_j . x_i where per-token keys scale
// x by their group scales (ksc) and add their group offsets times the query sums (kof, qsum).
template <int NV, int GH, int BITS>
void scores_run(const uint8_t* codes, int64_t row_bytes, int64_t n, int bits, const float* qk, const float* bias,
                const void* ksc, const void* kof, Dt sdt, int64_t kgr, const float* qsum, float* sb,
                const char* vis) {
  constexpr int L = Vec::size();
  constexpr int64_t D = NV * L;
  Vec qr[GH][NV];
#pragma GCC unroll 16
  for (int j = 0; j < GH; ++j)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) qr[j][v] = Vec::loadu(qk + j * D + v * L);
  alignas(64) float cf[D];
  alignas(64) float scs[TILE * 16], ofs[TILE * 16];
  const int64_t G = D / kgr;
  if (ksc != nullptr) {
    cvt_block(ksc, n * kgr, sdt, scs);
    cvt_block(kof, n * kgr, sdt, ofs);
  }
  int64_t gv[NV];  // the scale group of each vector (per-token keys)
  for (int v = 0; v < NV; ++v) gv[v] = (v * L) / G;
  // acc_j = qk_j . x_i (per-token scales applied); two partial sums per head (even / odd vectors) halve
  // the chain of dependent multiply-adds
  auto token = [&](int64_t i, Vec (&acc)[GH]) {
    Vec xs[NV];
    unpack_vecs<BITS, NV>(codes + i * row_bytes, bits, xs, cf);
    Vec part[2][GH];
#pragma GCC unroll 16
    for (int j = 0; j < GH; ++j) part[0][j] = part[1][j] = Vec(0.0f);
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      Vec x = xs[v];
      if (ksc != nullptr) x = x * Vec(scs[i * kgr + gv[v]]);
#pragma GCC unroll 16
      for (int j = 0; j < GH; ++j) part[v & 1][j] = at::vec::fmadd(qr[j][v], x, part[v & 1][j]);
    }
#pragma GCC unroll 16
    for (int j = 0; j < GH; ++j) acc[j] = part[0][j] + part[1][j];
  };
  auto bias_of = [&](int64_t i, int j) {
    float b0 = bias != nullptr ? bias[j] : 0.0f;
    if (ksc != nullptr)
      for (int64_t r = 0; r < kgr; ++r) b0 += ofs[i * kgr + r] * qsum[j * kgr + r];
    return b0;
  };
  int64_t i0 = 0;
#if defined(__AVX512F__)
  for (; i0 + 16 <= n; i0 += 16) {  // 16 rows at a time: one transposed reduction per head
    __m512 red[GH][16];
    for (int64_t i = 0; i < 16; ++i) {
      Vec acc[GH];
      token(i0 + i, acc);
#pragma GCC unroll 16
      for (int j = 0; j < GH; ++j) red[j][i] = acc[j];
    }
    bool all = true;
    for (int64_t i = 0; i < 16; ++i) all &= vis[i0 + i] != 0;
#pragma GCC unroll 16
    for (int j = 0; j < GH; ++j) {
      alignas(64) float out[16];
      _mm512_store_ps(out, reduce16(red[j]));
      float* dst = sb + j * TILE + i0;
      for (int64_t i = 0; i < 16; ++i) dst[i] = (all || vis[i0 + i]) ? out[i] + bias_of(i0 + i, j) : NINF;
    }
  }
#elif defined(__AVX2__)
  for (; i0 + 8 <= n; i0 += 8) {  // 8 rows at a time: one transposed reduction per head
    __m256 red[GH][8];
    for (int64_t i = 0; i < 8; ++i) {
      Vec acc[GH];
      token(i0 + i, acc);
#pragma GCC unroll 16
      for (int j = 0; j < GH; ++j) red[j][i] = acc[j];
    }
    bool all = true;
    for (int64_t i = 0; i < 8; ++i) all &= vis[i0 + i] != 0;
#pragma GCC unroll 16
    for (int j = 0; j < GH; ++j) {
      alignas(32) float out[8];
      _mm256_store_ps(out, reduce8(red[j]));
      float* dst = sb + j * TILE + i0;
      for (int64_t i = 0; i < 8; ++i) dst[i] = (all || vis[i0 + i]) ? out[i] + bias_of(i0 + i, j) : NINF;
    }
  }
#endif
  for (int64_t i = i0; i < n; ++i) {
    if (!vis[i]) continue;
    Vec acc[GH];
    token(i, acc);
#pragma GCC unroll 16
    for (int j = 0; j < GH; ++j) sb[j * TILE + i] = bias_of(i, j) + hsum(acc[j]);
  }
}

// values of n consecutive packed per-token rows: acc_j += sum_i (p_j,i s_i,r) code_i, offacc_j,r += p_j,i o_i,r.
// The weights w_j,r,i = p_j,i s_i,r are formed first, vectorised over the tokens (a hidden row's scale and
// offset count as 0, so whatever its slot holds never reaches the sums); the offset sums are dot products
// over the tokens. The codes are then read in passes of VB vectors: GH x VB accumulators stay in registers
// (16 on AVX2, 32 on AVX512), each code is converted once.
constexpr int vregs() {
#if defined(__AVX512F__)
  return 32;
#else
  return 16;
#endif
}

template <int NV, int GH>
constexpr int value_pass() {  // vectors per pass: the largest divisor of NV whose accumulators fit
  for (int vb = NV; vb > 1; --vb)
    if (NV % vb == 0 && GH * vb + vb + 2 <= vregs()) return vb;
  return 1;
}

template <int NV, int GH, int BITS>
void values_run(const uint8_t* codes, int64_t row_bytes, int64_t n, int bits, const float* p, const void* vsc,
                const void* vof, Dt sdt, int64_t vgr, float* acc, float* offacc, const char* vis) {
  constexpr int L = Vec::size();
  constexpr int64_t D = NV * L;
  constexpr int VB = value_pass<NV, GH>();
  alignas(64) float cf[D];
  alignas(64) float scs[TILE * 16], ofs[TILE * 16];  // token-major [n, vgr], as stored
  alignas(64) float sct[16 * TILE], oft[16 * TILE];  // channel-group-major [vgr, TILE]; hidden rows 0
  alignas(64) float w[GH * 16 * TILE];               // [GH, vgr, TILE]: p_j,i s_i,r
  cvt_block(vsc, n * vgr, sdt, scs);
  cvt_block(vof, n * vgr, sdt, ofs);
  for (int64_t r = 0; r < vgr; ++r)
    for (int64_t i = 0; i < n; ++i) {
      sct[r * TILE + i] = vis[i] ? scs[i * vgr + r] : 0.0f;
      oft[r * TILE + i] = vis[i] ? ofs[i * vgr + r] : 0.0f;
    }
#pragma GCC unroll 16
  for (int j = 0; j < GH; ++j)
    for (int64_t r = 0; r < vgr; ++r) {
      mul(p + j * TILE, sct + r * TILE, w + (j * vgr + r) * TILE, n);
      offacc[j * vgr + r] += dot(p + j * TILE, oft + r * TILE, n);
    }
  const int64_t G = D / vgr;
#pragma GCC unroll 16
  for (int v0 = 0; v0 < NV; v0 += VB) {
    Vec ar[GH][VB];
#pragma GCC unroll 16
    for (int j = 0; j < GH; ++j)
#pragma GCC unroll 16
      for (int v = 0; v < VB; ++v) ar[j][v] = Vec::loadu(acc + j * D + (v0 + v) * L);
    const int64_t r0 = (v0 * L) / G;  // the scale group of this pass's first vector
    const bool one_group = ((v0 + VB) * L - 1) / G == r0;
    for (int64_t i = 0; i < n; ++i) {
      if (!vis[i]) continue;
      Vec xs[NV];
      unpack_vecs<BITS, NV>(codes + i * row_bytes, bits, xs, cf);  // only this pass's vectors are used
      if (one_group) {
#pragma GCC unroll 16
        for (int j = 0; j < GH; ++j) {
          const Vec wj(w[(j * vgr + r0) * TILE + i]);
#pragma GCC unroll 16
          for (int v = 0; v < VB; ++v) ar[j][v] = at::vec::fmadd(wj, xs[v0 + v], ar[j][v]);
        }
      } else {
#pragma GCC unroll 16
        for (int j = 0; j < GH; ++j)
#pragma GCC unroll 16
          for (int v = 0; v < VB; ++v)
            ar[j][v] = at::vec::fmadd(Vec(w[(j * vgr + ((v0 + v) * L) / G) * TILE + i]), xs[v0 + v], ar[j][v]);
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < GH; ++j)
#pragma GCC unroll 16
      for (int v = 0; v < VB; ++v) ar[j][v].store(acc + j * D + (v0 + v) * L);
  }
}

using ScoresFn = void (*)(const uint8_t*, int64_t, int64_t, int, const float*, const float*, const void*,
                          const void*, Dt, int64_t, const float*, float*, const char*);
using ValuesFn = void (*)(const uint8_t*, int64_t, int64_t, int, const float*, const void*, const void*, Dt,
                          int64_t, float*, float*, const char*);

template <int NV, int BITS>
std::pair<ScoresFn, ValuesFn> runs_for_heads(int64_t g) {
  switch (g) {
    case 1: return {scores_run<NV, 1, BITS>, values_run<NV, 1, BITS>};
    case 2: return {scores_run<NV, 2, BITS>, values_run<NV, 2, BITS>};
    case 3: return {scores_run<NV, 3, BITS>, values_run<NV, 3, BITS>};
    case 4: return {scores_run<NV, 4, BITS>, values_run<NV, 4, BITS>};
    case 5: return {scores_run<NV, 5, BITS>, values_run<NV, 5, BITS>};
    case 6: return {scores_run<NV, 6, BITS>, values_run<NV, 6, BITS>};
    case 7: return {scores_run<NV, 7, BITS>, values_run<NV, 7, BITS>};
    case 8: return {scores_run<NV, 8, BITS>, values_run<NV, 8, BITS>};
    default: return {nullptr, nullptr};
  }
}

template <int NV>
std::pair<ScoresFn, ValuesFn> runs_for_bits(int64_t g, int64_t bits) {
  constexpr int P2 = NV * Vec::size() / 4, P4 = NV * Vec::size() / 2;  // packed bytes per row at 2 / 4 bits
  if constexpr (P4 % 16 == 0) {
    if (bits == 4) return runs_for_heads<NV, 4>(g);
  }
  if constexpr (P2 % 16 == 0) {
    if (bits == 2) return runs_for_heads<NV, 2>(g);
  }
  if (bits == 8) return runs_for_heads<NV, 8>(g);
  if (bits == 16) return runs_for_heads<NV, 16>(g);
  return runs_for_heads<NV, 0>(g);  // any width, unpacked through memory
}

// the register-blocked runs for head dim D, g query heads per KV head and the codes' width (nullptr: the
// generic loop)
std::pair<ScoresFn, ValuesFn> runs_for(int64_t D, int64_t g, int64_t bits) {
  if (D % Vec::size() != 0) return {nullptr, nullptr};
  const int64_t nv = D / Vec::size();
  if (nv == 4) return runs_for_bits<4>(g, bits);
  if (nv == 8) return runs_for_bits<8>(g, bits);
  return {nullptr, nullptr};
}

}  // namespace

// q: [B, H, D] float32 (already multiplied by nothing: `scale` is applied here); index: [B, H_kv, T] int32;
// qpos: [B] int64 (query positions); window <= 0: none. Returns [B, H, D] float32.
at::Tensor quant_decode(const at::Tensor& q, const at::Tensor& index, const at::Tensor& qpos,
                        const at::Tensor& sink_k, const at::Tensor& sink_v,
                        const at::Tensor& kc, const at::Tensor& ks, const at::Tensor& ko,
                        const c10::optional<at::Tensor>& klam, int64_t kbits, int64_t kgroup, bool kchannel,
                        const at::Tensor& vc, const at::Tensor& vs, const at::Tensor& vo, int64_t vbits,
                        int64_t vgroup, bool vchannel, const at::Tensor& res_k, const at::Tensor& res_v,
                        double scaling, int64_t window, int64_t split) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "qdecode: q [B, H, D] fp32");
  TORCH_CHECK(index.scalar_type() == at::kInt && index.stride(2) == 1, "qdecode: index int32, rows contiguous");
  TORCH_CHECK(qpos.scalar_type() == at::kLong && qpos.is_contiguous(), "qdecode: qpos int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t H_kv = index.size(1), T = index.size(2);
  TORCH_CHECK(H % H_kv == 0, "qdecode: H % H_kv");
  const int64_t g = H / H_kv;
  FpRegion SK, SV, RK, RV;
  SK.init(sink_k);
  SV.init(sink_v);
  RK.init(res_k);
  RV.init(res_v);
  Store K, V;
  K.init(kc, ks, ko, klam, kbits, kgroup, kchannel, D);
  V.init(vc, vs, vo, c10::nullopt, vbits, vgroup, vchannel, D);
  const int64_t S = SK.n;
  TORCH_CHECK(SV.n == S && S + K.n + RK.n == T && S + V.n + RV.n == T, "qdecode: regions do not add up to T");
  const float* qp = q.data_ptr<float>();
  const int32_t* ip = index.data_ptr<int32_t>();
  const int64_t* pp = qpos.data_ptr<int64_t>();
  const float sc = static_cast<float>(scaling);

  const int64_t nsplit = std::max<int64_t>(1, std::min<int64_t>(split, T));
  const int64_t span = (T + nsplit - 1) / nsplit;
  const int64_t units = B * H_kv * nsplit;
  std::vector<float> pm(units * g), pl(units * g), pacc(units * g * D);

  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    const int64_t kgr = K.channel ? D : std::max<int64_t>(1, D / K.group);  // key scale columns
    const int64_t vgr_n = V.channel ? D : std::max<int64_t>(1, D / V.group);
    std::vector<float> qv(g * D), qk(g * D), qsum(g * kgr), bias(g), cf(D), vrow(D), buf(D), sb(g * TILE);
    std::vector<char> vis(TILE);
    std::vector<float> m(g), l(g), acc(g * D), offacc(g * vgr_n), w(g);
    const ScoresFn fast_scores = runs_for(D, g, K.bits).first;
    const ValuesFn fast_values = runs_for(D, g, V.bits).second;
    // the runs handle scale groups of whole vectors (at most 16 groups per row)
    const bool kgr_fast = (D / kgr) % Vec::size() == 0 && kgr <= 16;
    const bool vgr_fast = (D / vgr_n) % Vec::size() == 0 && vgr_n <= 16;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t bh = u / nsplit, part = u % nsplit, b = bh / H_kv, h = bh % H_kv;
      const int64_t a0 = part * span, a1 = std::min<int64_t>(T, a0 + span);
      for (int64_t j = 0; j < g; ++j) {
        const float* src = qp + (b * H + h * g + j) * D;
        for (int64_t c = 0; c < D; ++c) qv[j * D + c] = src[c] * sc;
      }
      if (!K.channel) {  // per-token keys: q * smoothing, and its per-group sums
        for (int64_t j = 0; j < g; ++j) {
          for (int64_t c = 0; c < D; ++c) qk[j * D + c] = qv[j * D + c] * (K.lam ? K.lam[h * D + c] : 1.0f);
          const int64_t G = D / kgr;
          for (int64_t r = 0; r < kgr; ++r) {
            float t = 0.0f;
            for (int64_t c = r * G; c < (r + 1) * G; ++c) t += qk[j * D + c];
            qsum[j * kgr + r] = t;
          }
        }
      }
      std::fill(m.begin(), m.end(), NINF);
      std::fill(l.begin(), l.end(), 0.0f);
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(offacc.begin(), offacc.end(), 0.0f);
      const int32_t* idx = ip + b * index.stride(0) + h * index.stride(1);
      const int64_t qp_b = pp[b];
      int64_t cur_gi = -1;  // per-channel key group whose scales are folded into qk / bias
      const uint8_t* kcodes = K.codes + b * K.cs_b + h * K.cs_h;
      const uint8_t* vcodes = V.codes + b * V.cs_b + h * V.cs_h;
      for (int64_t t0 = a0; t0 < a1; t0 += TILE) {
        const int64_t t1 = std::min<int64_t>(a1, t0 + TILE), n = t1 - t0;
        {  // software prefetch of the tile after next (packed rows, their scales, the index): DRAM streams
          const int64_t f0 = t0 + PREFETCH_TILES * TILE, f1 = std::min<int64_t>(a1, f0 + TILE);
          if (PREFETCH_TILES > 0 && f0 < f1) {
            prefetch(idx + f0, (f1 - f0) * 4);
            if (f0 >= S && f0 < S + K.n)
              prefetch(kcodes + (f0 - S) * K.row_bytes, (std::min<int64_t>(f1, S + K.n) - f0) * K.row_bytes);
            if (f0 >= S && f0 < S + V.n) {
              const int64_t nn = std::min<int64_t>(f1, S + V.n) - f0;
              prefetch(vcodes + (f0 - S) * V.row_bytes, nn * V.row_bytes);
              if (!V.channel) {
                const int64_t off = (b * V.ss_b + h * V.ss_h + (f0 - S) * vgr_n) * esz(V.sdt);
                prefetch(static_cast<const char*>(V.scale) + off, nn * vgr_n * esz(V.sdt));
                prefetch(static_cast<const char*>(V.offset) + off, nn * vgr_n * esz(V.sdt));
              }
            }
            if (!K.channel && f0 >= S && f0 < S + K.n) {
              const int64_t nn = std::min<int64_t>(f1, S + K.n) - f0;
              const int64_t off = (b * K.ss_b + h * K.ss_h + (f0 - S) * kgr) * esz(K.sdt);
              prefetch(static_cast<const char*>(K.scale) + off, nn * kgr * esz(K.sdt));
              prefetch(static_cast<const char*>(K.offset) + off, nn * kgr * esz(K.sdt));
            }
          }
        }
        bool any = false;
        int64_t tv = t0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
        {  // 16 slots at a time: 0 <= pos <= q_pos (and pos > q_pos - window)
          const __m512i zero = _mm512_setzero_si512(), top = _mm512_set1_epi32(static_cast<int32_t>(qp_b));
          const __m512i low = _mm512_set1_epi32(window > 0 ? static_cast<int32_t>(qp_b - window)
                                                           : std::numeric_limits<int32_t>::min());
          for (; tv + 16 <= t1; tv += 16) {
            const __m512i p = _mm512_loadu_si512(idx + tv);
            const __mmask16 ok = _mm512_cmpge_epi32_mask(p, zero) & _mm512_cmple_epi32_mask(p, top) &
                                 _mm512_cmpgt_epi32_mask(p, low);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(vis.data() + tv - t0), _mm_movm_epi8(ok));
            any |= ok != 0;
            if (ok != 0xFFFF)
              for (int64_t i = 0; i < 16; ++i)
                if (!((ok >> i) & 1))
                  for (int64_t j = 0; j < g; ++j) sb[j * TILE + tv + i - t0] = NINF;
          }
        }
#elif defined(__AVX2__)
        {  // 8 slots at a time: 0 <= pos <= q_pos (and pos > q_pos - window)
          const __m256i neg = _mm256_set1_epi32(-1), top = _mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(qp_b, std::numeric_limits<int32_t>::max() - 1)) + 1);
          const __m256i low = _mm256_set1_epi32(window > 0 ? static_cast<int32_t>(qp_b - window)
                                                           : std::numeric_limits<int32_t>::min());
          for (; qp_b < std::numeric_limits<int32_t>::max() && tv + 8 <= t1; tv += 8) {
            const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + tv));
            // pos > -1, q_pos + 1 > pos, pos > low (q_pos < 2^31 - 1: positions are int32)
            const __m256i ok = _mm256_and_si256(_mm256_and_si256(_mm256_cmpgt_epi32(p, neg), _mm256_cmpgt_epi32(top, p)),
                                                _mm256_cmpgt_epi32(p, low));
            const int bits8 = _mm256_movemask_ps(_mm256_castsi256_ps(ok));
            for (int64_t i = 0; i < 8; ++i) vis[tv + i - t0] = (bits8 >> i) & 1;
            any |= bits8 != 0;
            if (bits8 != 0xFF)
              for (int64_t i = 0; i < 8; ++i)
                if (!((bits8 >> i) & 1))
                  for (int64_t j = 0; j < g; ++j) sb[j * TILE + tv + i - t0] = NINF;
          }
        }
#endif
        for (int64_t t = tv; t < t1; ++t) {  // visibility; invisible slots score -inf
          const int32_t pos = idx[t];
          const bool ok = pos >= 0 && pos <= qp_b && !(window > 0 && pos <= qp_b - window);
          vis[t - t0] = ok;
          any |= ok;
          if (!ok)
            for (int64_t j = 0; j < g; ++j) sb[j * TILE + t - t0] = NINF;
        }
        if (!any) continue;
        // ---- scores sb[j][t - t0] = q_j . k_t (scaled)
        for (int64_t t = t0; t < t1;) {
          if (t < S || t >= S + K.n) {  // full-precision sink / residual key
            if (vis[t - t0]) {
              const FpRegion& R = t < S ? SK : RK;
              const int64_t r = t < S ? t : t - S - K.n;
              const float* kr = row_f32(R.p, b * R.sb + h * R.sh + r * R.st, D, R.dt, buf.data());
              for (int64_t j = 0; j < g; ++j) sb[j * TILE + t - t0] = dot(qv.data() + j * D, kr, D);
            }
            ++t;
            continue;
          }
          const int64_t r = t - S;
          int64_t e = std::min<int64_t>(t1, S + K.n);  // a run of packed keys (one scale group if per channel)
          if (K.channel) {
            const int64_t gi = r / K.group;
            e = std::min<int64_t>(e, S + (gi + 1) * K.group);
            if (gi != cur_gi) {  // fold this group's per-channel scales into the queries
              const int64_t off = (b * K.ss_b + h * K.ss_h + gi * D) * esz(K.sdt);
              cvt_block(static_cast<const char*>(K.scale) + off, D, K.sdt, buf.data());
              cvt_block(static_cast<const char*>(K.offset) + off, D, K.sdt, vrow.data());
              for (int64_t j = 0; j < g; ++j) {
                mul(qv.data() + j * D, buf.data(), qk.data() + j * D, D);
                bias[j] = dot(qv.data() + j * D, vrow.data(), D);
              }
              cur_gi = gi;
            }
          }
          const int64_t soff = b * K.ss_b + h * K.ss_h + r * kgr;  // per-token key scales of row r
          if (fast_scores != nullptr && (K.channel || kgr_fast)) {
            fast_scores(kcodes + r * K.row_bytes, K.row_bytes, e - t, static_cast<int>(K.bits), qk.data(),
                        K.channel ? bias.data() : nullptr,
                        K.channel ? nullptr : static_cast<const char*>(K.scale) + soff * esz(K.sdt),
                        K.channel ? nullptr : static_cast<const char*>(K.offset) + soff * esz(K.sdt), K.sdt, kgr,
                        qsum.data(), sb.data() + (t - t0), vis.data() + (t - t0));
            t = e;
            continue;
          }
          for (; t < e; ++t) {
            if (!vis[t - t0]) continue;
            const int64_t rr = t - S;
            unpack_row(kcodes + rr * K.row_bytes, D, K.bits, cf.data());
            if (K.channel) {
              for (int64_t j = 0; j < g; ++j) sb[j * TILE + t - t0] = bias[j] + dot(qk.data() + j * D, cf.data(), D);
            } else {
              const int64_t off = b * K.ss_b + h * K.ss_h + rr * kgr, G = D / kgr;
              for (int64_t j = 0; j < g; ++j) {
                float sj = 0.0f;
                for (int64_t gr = 0; gr < kgr; ++gr) {
                  sj += ld(K.scale, off + gr, K.sdt) * dot(qk.data() + j * D + gr * G, cf.data() + gr * G, G) +
                        ld(K.offset, off + gr, K.sdt) * qsum[j * kgr + gr];
                }
                sb[j * TILE + t - t0] = sj;
              }
            }
          }
        }
        if (!any) continue;
        // ---- online softmax over the tile: sb <- exp(sb - m')
        for (int64_t j = 0; j < g; ++j) {
          float* row = sb.data() + j * TILE;
          float mx = std::max(m[j], row_max(row, n));
          if (mx == NINF) {
            std::fill(row, row + n, 0.0f);
            continue;
          }
          const float alpha = std::exp(m[j] - mx);  // 0 when m was -inf
          const float sum = exp_shift_sum(row, n, mx);
          if (alpha != 1.0f) {
            scale(alpha, acc.data() + j * D, D);
            for (int64_t r = 0; r < vgr_n; ++r) offacc[j * vgr_n + r] *= alpha;
          }
          l[j] = l[j] * alpha + sum;
          m[j] = mx;
        }
        // ---- values: acc_j += p_j,t v_t
        for (int64_t t = t0; t < t1;) {
          if (t < S || t >= S + V.n) {  // full-precision sink / residual value
            if (vis[t - t0]) {
              const FpRegion& R = t < S ? SV : RV;
              const int64_t r = t < S ? t : t - S - V.n;
              const float* vr = row_f32(R.p, b * R.sb + h * R.sh + r * R.st, D, R.dt, buf.data());
              for (int64_t j = 0; j < g; ++j) axpy(sb[j * TILE + t - t0], vr, acc.data() + j * D, D);
            }
            ++t;
            continue;
          }
          const int64_t r = t - S;
          const int64_t e = std::min<int64_t>(t1, S + V.n);
          if (fast_values != nullptr && !V.channel && vgr_fast) {
            const int64_t off = b * V.ss_b + h * V.ss_h + r * vgr_n;
            fast_values(vcodes + r * V.row_bytes, V.row_bytes, e - t, static_cast<int>(V.bits), sb.data() + (t - t0),
                        static_cast<const char*>(V.scale) + off * esz(V.sdt),
                        static_cast<const char*>(V.offset) + off * esz(V.sdt), V.sdt, vgr_n, acc.data(),
                        offacc.data(), vis.data() + (t - t0));
            t = e;
            continue;
          }
          for (; t < e; ++t) {
            if (!vis[t - t0]) continue;
            for (int64_t j = 0; j < g; ++j) w[j] = sb[j * TILE + t - t0];
            const int64_t rr = t - S;
            unpack_row(vcodes + rr * V.row_bytes, D, V.bits, cf.data());
            if (!V.channel) {
              const int64_t off = b * V.ss_b + h * V.ss_h + rr * vgr_n, G = D / vgr_n;
              for (int64_t gr = 0; gr < vgr_n; ++gr) {
                const float vs_ = ld(V.scale, off + gr, V.sdt), vo_ = ld(V.offset, off + gr, V.sdt);
                for (int64_t j = 0; j < g; ++j) {
                  axpy(w[j] * vs_, cf.data() + gr * G, acc.data() + j * D + gr * G, G);
                  offacc[j * vgr_n + gr] += w[j] * vo_;
                }
              }
            } else {  // per-channel values: dequantise the row, then accumulate
              const int64_t off = b * V.ss_b + h * V.ss_h + (rr / V.group) * D;
              for (int64_t c = 0; c < D; ++c) {
                vrow[c] = cf[c] * ld(V.scale, off + c, V.sdt) + ld(V.offset, off + c, V.sdt);
              }
              for (int64_t j = 0; j < g; ++j) axpy(w[j], vrow.data(), acc.data() + j * D, D);
            }
          }
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        float* dst = pacc.data() + (u * g + j) * D;
        const int64_t G = D / vgr_n;
        for (int64_t c = 0; c < D; ++c) dst[c] = acc[j * D + c] + (V.channel ? 0.0f : offacc[j * vgr_n + c / G]);
        pm[u * g + j] = m[j];
        pl[u * g + j] = l[j];
      }
    }
  });

  auto out = at::empty({B, H, D}, q.options());
  float* op = out.data_ptr<float>();
  for (int64_t bh = 0; bh < B * H_kv; ++bh) {  // merge the ranges of each (b, kv head)
    const int64_t b = bh / H_kv, h = bh % H_kv;
    for (int64_t j = 0; j < g; ++j) {
      float M = NINF;
      for (int64_t p = 0; p < nsplit; ++p) M = std::max(M, pm[(bh * nsplit + p) * g + j]);
      float* dst = op + (b * H + h * g + j) * D;
      std::fill(dst, dst + D, 0.0f);
      if (M == NINF) continue;  // no visible key: zeros
      float L = 0.0f;
      for (int64_t p = 0; p < nsplit; ++p) {
        const int64_t u = bh * nsplit + p;
        if (pm[u * g + j] == NINF) continue;
        const float e = std::exp(pm[u * g + j] - M);
        L += pl[u * g + j] * e;
        axpy(e, pacc.data() + (u * g + j) * D, dst, D);
      }
      scale(1.0f / L, dst, D);
    }
  }
  return out;
}

// ---- paged sparse decode -----------------------------------------------------------------------------------
// Register-blocked tile steps for head dim D = NV vectors and GH query heads per KV head (the rows of a tile are
// gathered slots, so they are addressed through tb[]): logits with 8 (AVX2) or 16 (AVX-512) rows per
// transposed reduction, values in passes of VB vectors whose GH x VB accumulators stay in registers.
#if defined(__AVX512F__)
using RawVec = __m512;
constexpr int ROWS_PER_REDUCTION = 16;
inline void store_row_sums(float* dst, const RawVec* r) { _mm512_storeu_ps(dst, reduce16(r)); }
#elif defined(__AVX2__)
using RawVec = __m256;
constexpr int ROWS_PER_REDUCTION = 8;
inline void store_row_sums(float* dst, const RawVec* r) { _mm256_storeu_ps(dst, reduce8(r)); }
#endif
using PagedScoresFn = void (*)(const float*, const float*, int64_t, const int64_t*, int64_t, float*);
using PagedValuesFn = void (*)(const float*, int64_t, const int64_t*, int64_t, const float*, float*);

template <int NV, int GH>
void paged_scores(const float* qs, const float* K, int64_t kt, const int64_t* tb, int64_t n, float* sb) {
  constexpr int L = Vec::size();
  constexpr int64_t D = NV * L;
  auto row = [&](int64_t r, Vec (&a)[GH]) {
    const float* kr = K + tb[r] * kt;
#pragma GCC unroll 16
    for (int j = 0; j < GH; ++j) a[j] = Vec(0.0f);
#pragma GCC unroll 32
    for (int c = 0; c < NV; ++c) {
      const Vec x = Vec::loadu(kr + c * L);
#pragma GCC unroll 16
      for (int j = 0; j < GH; ++j) a[j] = at::vec::fmadd(Vec::loadu(qs + j * D + c * L), x, a[j]);
    }
  };
  int64_t r0 = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  for (; r0 + ROWS_PER_REDUCTION <= n; r0 += ROWS_PER_REDUCTION) {  // one transposed reduction per head
    RawVec red[GH][ROWS_PER_REDUCTION];
    for (int r = 0; r < ROWS_PER_REDUCTION; ++r) {
      Vec a[GH];
      row(r0 + r, a);
#pragma GCC unroll 16
      for (int j = 0; j < GH; ++j) red[j][r] = a[j];
    }
#pragma GCC unroll 16
    for (int j = 0; j < GH; ++j) store_row_sums(sb + j * TILE + r0, red[j]);
  }
#endif
  for (; r0 < n; ++r0) {
    Vec a[GH];
    row(r0, a);
    for (int j = 0; j < GH; ++j) sb[j * TILE + r0] = hsum(a[j]);
  }
}

template <int NV, int GH>
void paged_values(const float* V, int64_t vt, const int64_t* tb, int64_t n, const float* p, float* acc) {
  constexpr int L = Vec::size();
  constexpr int64_t D = NV * L;
  constexpr int VB = value_pass<NV, GH>();
#pragma GCC unroll 16
  for (int v0 = 0; v0 < NV; v0 += VB) {
    Vec ar[GH][VB];
#pragma GCC unroll 16
    for (int j = 0; j < GH; ++j)
#pragma GCC unroll 16
      for (int v = 0; v < VB; ++v) ar[j][v] = Vec::loadu(acc + j * D + (v0 + v) * L);
    for (int64_t i = 0; i < n; ++i) {
      const float* vr = V + tb[i] * vt + v0 * L;
      Vec xs[VB];
#pragma GCC unroll 16
      for (int v = 0; v < VB; ++v) xs[v] = Vec::loadu(vr + v * L);
#pragma GCC unroll 16
      for (int j = 0; j < GH; ++j) {
        const Vec w(p[j * TILE + i]);
#pragma GCC unroll 16
        for (int v = 0; v < VB; ++v) ar[j][v] = at::vec::fmadd(w, xs[v], ar[j][v]);
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < GH; ++j)
#pragma GCC unroll 16
      for (int v = 0; v < VB; ++v) ar[j][v].store(acc + j * D + (v0 + v) * L);
  }
}

template <int NV>
std::pair<PagedScoresFn, PagedValuesFn> paged_runs_for_heads(int64_t g) {
  switch (g) {
    case 1: return {paged_scores<NV, 1>, paged_values<NV, 1>};
    case 2: return {paged_scores<NV, 2>, paged_values<NV, 2>};
    case 3: return {paged_scores<NV, 3>, paged_values<NV, 3>};
    case 4: return {paged_scores<NV, 4>, paged_values<NV, 4>};
    case 5: return {paged_scores<NV, 5>, paged_values<NV, 5>};
    case 6: return {paged_scores<NV, 6>, paged_values<NV, 6>};
    case 7: return {paged_scores<NV, 7>, paged_values<NV, 7>};
    case 8: return {paged_scores<NV, 8>, paged_values<NV, 8>};
    default: return {nullptr, nullptr};
  }
}

// the register-blocked tile steps for head dim D and g heads sharing a slot list (nullptr: the generic loop)
std::pair<PagedScoresFn, PagedValuesFn> paged_runs(int64_t D, int64_t g) {
  if (D % Vec::size() != 0) return {nullptr, nullptr};
  const int64_t nv = D / Vec::size();
  if (nv == 4) return paged_runs_for_heads<4>(g);
  if (nv == 8) return paged_runs_for_heads<8>(g);
  if (nv == 16) return paged_runs_for_heads<16>(g);
  return {nullptr, nullptr};
}

// The g query heads of one KV head over one slot list (g = 1: one query head over its own list; g > 1: the
// list the group shares, Quest's selection=group, so every K/V row is read from memory once for the g heads).
// TILE slots per online-softmax step: the tile's visible slots are gathered, their logits computed, then one
// max, one rescale and one vectorised exp per tile and head, then the values accumulated.
// qs: [g, D] (scaled); acc: [g, D]; m, l: [g] (running max, sum of exp(logit - m)).
void paged_group(const float* qs, int64_t g, const float* K, const float* V, const int32_t* I, int64_t kt,
                 int64_t vt, int64_t it, const int64_t* sl, int64_t S, int64_t T, int64_t qpos, int64_t D,
                 float* acc, float* m, float* l) {
  const auto runs = paged_runs(D, g);
  std::vector<float> sb(g * TILE);
  int64_t tb[TILE];
  std::fill(acc, acc + g * D, 0.0f);
  std::fill(m, m + g, NINF);
  std::fill(l, l + g, 0.0f);
  for (int64_t i0 = 0; i0 < S; i0 += TILE) {
    const int64_t i1 = std::min(S, i0 + TILE);
    int64_t n = 0;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = sl[i];
      if (t < 0 || t >= T) continue;
      const int32_t pos = I[t * it];
      if (pos < 0 || pos > qpos) continue;
      tb[n++] = t;
    }
    if (n == 0) continue;
    for (int64_t i = i1; i < std::min(S, i1 + TILE); ++i) {  // the next tile's rows: pages are scattered
      const int64_t t = sl[i];
      if (t < 0 || t >= T) continue;
      prefetch(K + t * kt, D * 4);
      prefetch(V + t * vt, D * 4);
    }
    if (runs.first != nullptr) {
      runs.first(qs, K, kt, tb, n, sb.data());
    } else {
      for (int64_t r = 0; r < n; ++r) {
        const float* kr = K + tb[r] * kt;
        for (int64_t j = 0; j < g; ++j) sb[j * TILE + r] = dot(qs + j * D, kr, D);
      }
    }
    for (int64_t j = 0; j < g; ++j) {
      float* row = sb.data() + j * TILE;
      const float mx = std::max(m[j], row_max(row, n));
      const float alpha = std::exp(m[j] - mx);  // 0 when m was -inf
      const float sum = exp_shift_sum(row, n, mx);
      if (alpha != 1.0f) scale(alpha, acc + j * D, D);
      l[j] = l[j] * alpha + sum;
      m[j] = mx;
    }
    if (runs.second != nullptr) {
      runs.second(V, vt, tb, n, sb.data(), acc);
    } else {
      for (int64_t r = 0; r < n; ++r) {
        const float* vr = V + tb[r] * vt;
        for (int64_t j = 0; j < g; ++j) axpy(sb[j * TILE + r], vr, acc + j * D, D);
      }
    }
  }
}

// q: [B, H, D] fp32; k, v: [B, H_kv, T, D] fp32 (last dim contiguous); index: [B, H_kv, T] int32;
// qpos: [B] int64; slots: [B, H, S] int64 (each query head's slots, any order; -1 = none).
// slots may instead be [B, H_kv, S]: one list shared by the query heads of each KV head (read once for them).
// Returns (out [B, H, D], lse [B, H]); a head with no visible key gets 0 and -inf.
std::vector<at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& index, const at::Tensor& qpos, const at::Tensor& slots,
                                     double scaling) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "paged: q [B, H, D] fp32");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "paged: k/v fp32");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "paged: k/v rows contiguous");
  TORCH_CHECK(index.scalar_type() == at::kInt && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "paged: index int32, slots int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), H_kv = k.size(1), T = k.size(2);
  const int64_t S = slots.size(2), g = H / H_kv;
  TORCH_CHECK(slots.dim() == 3 && slots.size(0) == B && (slots.size(1) == H || slots.size(1) == H_kv),
              "paged: slots [B, H, S] or [B, H_kv, S]");
  const bool shared = slots.size(1) == H_kv && g > 1;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int32_t* ip = index.data_ptr<int32_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = qpos.data_ptr<int64_t>();
  const int64_t kb = k.stride(0), kh = k.stride(1), kt = k.stride(2);
  const int64_t vb = v.stride(0), vh = v.stride(1), vt = v.stride(2);
  const int64_t ib = index.stride(0), ih = index.stride(1), it = index.stride(2);
  auto out = at::empty({B, H, D}, q.options());
  auto lse = at::empty({B, H}, q.options());
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float sc = static_cast<float>(scaling);
  auto finish = [&](int64_t u, const float* acc, float m, float l) {
    float* dst = op + u * D;
    if (l > 0.0f) {
      const float inv = 1.0f / l;
      for (int64_t c = 0; c < D; ++c) dst[c] = acc[c] * inv;
      lp[u] = m + std::log(l);
    } else {
      std::fill(dst, dst + D, 0.0f);
      lp[u] = NINF;
    }
  };
  if (shared) {
    at::parallel_for(0, B * H_kv, 1, [&](int64_t w0, int64_t w1) {
      std::vector<float> qs(g * D), acc(g * D), m(g), l(g);
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t b = w / H_kv, h = w % H_kv, u0 = b * H + h * g;
        for (int64_t c = 0; c < g * D; ++c) qs[c] = qp[u0 * D + c] * sc;
        paged_group(qs.data(), g, kp + b * kb + h * kh, vp + b * vb + h * vh, ip + b * ib + h * ih, kt, vt, it,
                    sp + w * S, S, T, pp[b], D, acc.data(), m.data(), l.data());
        for (int64_t j = 0; j < g; ++j) finish(u0 + j, acc.data() + j * D, m[j], l[j]);
      }
    });
    return {out, lse};
  }
  at::parallel_for(0, B * H, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> qs(D), acc(D);
    float m, l;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / H, h = (u % H) / g;
      for (int64_t c = 0; c < D; ++c) qs[c] = qp[u * D + c] * sc;
      paged_group(qs.data(), 1, kp + b * kb + h * kh, vp + b * vb + h * vh, ip + b * ib + h * ih, kt, vt, it,
                  sp + u * S, S, T, pp[b], D, acc.data(), &m, &l);
      finish(u, acc.data(), m, l);
    }
  });
  return {out, lse};
}

// ---- Quest page selection ------------------------------------------------------------------------------
// page_select: Quest's bound on any key's logit in page p (Tang et al. 2024, arXiv:2406.10774),
//   U_p = sum_c max(q_c m_pc, q_c M_pc) = q.center_p + |q|.radius_p   (center = (M+m)/2, radius = (M-m)/2),
// per query head, or with group = true the largest bound over the g query heads of a KV head; -inf for a page
// that holds no real token (NaN ranks as +inf, as torch.topk ranks it). The top k pages by U (ties: the
// lower page first), sorted ascending, and their slots p*P .. p*P+P-1 followed by the last page's slots
// last*P .. T-1, last = (T-1) / P. One pass over the summaries per (row, KV head): the g heads' bounds are
// computed from one read of each summary row; nth_element finds the k-th bound, one scan takes the pages.
// q: [B, H, D] fp32; center, radius: [B, H_kv, n, D] fp32 contiguous; ok: [B, H_kv, n] bool contiguous;
// 0 < k <= n; n * P <= last * P.  Returns (slots [B, R, k*P + T - last*P] int64, pages [B, R, k] int64),
// R = H_kv when group else H.
std::vector<at::Tensor> page_select(const at::Tensor& q, const at::Tensor& center, const at::Tensor& radius,
                                    const at::Tensor& ok, int64_t k, int64_t P, int64_t T, bool group) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "select: q [B, H, D] fp32");
  TORCH_CHECK(center.scalar_type() == at::kFloat && radius.scalar_type() == at::kFloat && center.dim() == 4 &&
              center.is_contiguous() && radius.is_contiguous() && center.sizes() == radius.sizes(),
              "select: center/radius [B, H_kv, n, D] fp32 contiguous");
  TORCH_CHECK(ok.scalar_type() == at::kBool && ok.is_contiguous() && ok.dim() == 3, "select: ok [B, H_kv, n]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), H_kv = center.size(1), n = center.size(2);
  TORCH_CHECK(center.size(0) == B && center.size(3) == D && H_kv > 0 && H % H_kv == 0, "select: shapes");
  TORCH_CHECK(ok.size(0) == B && ok.size(1) == H_kv && ok.size(2) == n, "select: ok shape");
  TORCH_CHECK(P > 0 && T > 0 && k > 0 && k <= n && n * P <= ((T - 1) / P) * P, "select: 0 < k <= n pages");
  const int64_t g = H / H_kv, R = group ? H_kv : H;
  const int64_t last = (T - 1) / P, S = k * P + (T - last * P);
  auto slots = at::empty({B, R, S}, q.options().dtype(at::kLong));
  auto pages = at::empty({B, R, k}, q.options().dtype(at::kLong));
  const float* qp = q.data_ptr<float>();
  const float* cp = center.data_ptr<float>();
  const float* rp = radius.data_ptr<float>();
  const bool* op = ok.data_ptr<bool>();
  int64_t* sp = slots.data_ptr<int64_t>();
  int64_t* pp = pages.data_ptr<int64_t>();
  const float inf = std::numeric_limits<float>::infinity();
  // one (row, KV head) per unit: the g heads' bounds from one read of each summary row, then the top k of
  // each head's bounds (group: of their maximum). Top k: the k-th largest bound by nth_element on a copy,
  // then one ascending scan takes the pages above it and, of those equal to it, the lowest first.
  at::parallel_for(0, B * H_kv, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> u(g * n), qa(g * D), tmp(n);
    auto pick = [&](const float* s, int64_t r) {
      int64_t* pg = pp + r * k;
      int64_t* st = sp + r * S;
      float thr = NINF;
      int64_t ties = n;  // pages equal to thr still to take
      if (k < n) {
        std::copy(s, s + n, tmp.begin());
        std::nth_element(tmp.begin(), tmp.begin() + (k - 1), tmp.end(), std::greater<float>());
        thr = tmp[k - 1];
        int64_t above = 0;
        for (int64_t p = 0; p < n; ++p) above += s[p] > thr;
        ties = k - above;
      }
      for (int64_t p = 0, i = 0; p < n && i < k; ++p) {
        if (!(s[p] > thr || (s[p] == thr && ties-- > 0))) continue;
        pg[i++] = p;
        for (int64_t o = 0; o < P; ++o) *st++ = p * P + o;
      }
      for (int64_t t = last * P; t < T; ++t) *st++ = t;
    };
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / H_kv, kv = w % H_kv, base = w * n;
      const float* qs = qp + (b * H + kv * g) * D;  // the g query heads of this KV head
      for (int64_t c = 0; c < g * D; ++c) qa[c] = std::abs(qs[c]);
      auto bound = [&](int64_t p, int64_t j) {  // one page's bound for head j, one horizontal sum
        const float* cr = cp + (base + p) * D;
        const float* rr = rp + (base + p) * D;
        const float* qj = qs + j * D;
        const float* aj = qa.data() + j * D;
        int64_t c = 0;
        Vec acc(0.0f);
        for (; c + Vec::size() <= D; c += Vec::size()) {
          acc = at::vec::fmadd(Vec::loadu(qj + c), Vec::loadu(cr + c), acc);
          acc = at::vec::fmadd(Vec::loadu(aj + c), Vec::loadu(rr + c), acc);
        }
        float v = hsum(acc);
        for (; c < D; ++c) v += qj[c] * cr[c] + aj[c] * rr[c];
        return v;
      };
      int64_t p0 = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
      if (D % Vec::size() == 0) {  // blocks of pages: one transposed reduction per head and block
        constexpr int RB = ROWS_PER_REDUCTION;
        for (; p0 + RB <= n; p0 += RB) {
          for (int64_t j = 0; j < g; ++j) {
            const float* qj = qs + j * D;
            const float* aj = qa.data() + j * D;
            RawVec red[RB];
            for (int r = 0; r < RB; ++r) {
              const float* cr = cp + (base + p0 + r) * D;
              const float* rr = rp + (base + p0 + r) * D;
              Vec acc(0.0f);
              for (int64_t c = 0; c < D; c += Vec::size()) {
                acc = at::vec::fmadd(Vec::loadu(qj + c), Vec::loadu(cr + c), acc);
                acc = at::vec::fmadd(Vec::loadu(aj + c), Vec::loadu(rr + c), acc);
              }
              red[r] = acc;
            }
            store_row_sums(u.data() + j * n + p0, red);
          }
        }
      }
#endif
      for (; p0 < n; ++p0)
        for (int64_t j = 0; j < g; ++j) u[j * n + p0] = bound(p0, j);
      for (int64_t p = 0; p < n; ++p) {  // empty pages -inf; NaN ranks as +inf
        const bool empty = !op[base + p];
        for (int64_t j = 0; j < g; ++j) {
          float& v = u[j * n + p];
          v = empty ? NINF : (std::isnan(v) ? inf : v);
        }
      }
      if (group) {
        for (int64_t j = 1; j < g; ++j)
          for (int64_t p = 0; p < n; ++p) u[p] = std::max(u[p], u[j * n + p]);
        pick(u.data(), w);  // row b * H_kv + kv
      } else {
        for (int64_t j = 0; j < g; ++j) pick(u.data() + j * n, b * H + kv * g + j);
      }
    }
  });
  return {slots, pages};
}

// page_marks_match: whether each of the n summarised pages still starts and ends at the positions recorded
// when it was summarised (marks [B, H_kv, n, 2] int32 = index[..., p*P] and index[..., p*P + P - 1]); false
// once an eviction repacked the layer. index: [B, H_kv, T] int32 (any strides), n * P <= T.
bool page_marks_match(const at::Tensor& index, const at::Tensor& marks, int64_t P) {
  TORCH_CHECK(index.scalar_type() == at::kInt && index.dim() == 3, "marks: index [B, H_kv, T] int32");
  TORCH_CHECK(marks.scalar_type() == at::kInt && marks.dim() == 4 && marks.size(3) == 2 && marks.is_contiguous(),
              "marks: [B, H_kv, n, 2] int32 contiguous");
  const int64_t B = index.size(0), H_kv = index.size(1), T = index.size(2), n = marks.size(2);
  TORCH_CHECK(marks.size(0) == B && marks.size(1) == H_kv && P > 0 && n * P <= T, "marks: shapes");
  const int32_t* ip = index.data_ptr<int32_t>();
  const int32_t* mp = marks.data_ptr<int32_t>();
  const int64_t ib = index.stride(0), ih = index.stride(1), it = index.stride(2);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H_kv; ++h) {
      const int32_t* I = ip + b * ib + h * ih;
      const int32_t* M = mp + (b * H_kv + h) * n * 2;
      for (int64_t p = 0; p < n; ++p) {
        if (I[p * P * it] != M[2 * p] || I[(p * P + P - 1) * it] != M[2 * p + 1]) return false;
      }
    }
  }
  return true;
}

// ---- per-token quantization, packed --------------------------------------------------------------------
// quantize_tokens_packed: the decode-step fast path of longlab.quant.quantizer.quantize_tokens + pack,
// bit-identical to them (the tests compare): per token, in groups of G channels,
//   offset = lo rounded to the scale dtype towards -inf, scale = max(hi - offset, 0) / (2^bits - 1) rounded
//   towards +inf, code = clamp(round_half_even((x - offset) / (scale > 0 ? scale : 1)), 0, 2^bits - 1),
// codes planar-packed. A KIVI value enters the packed store this way at every decode step: about forty
// small PyTorch ops per layer before, one call now.

namespace {

template <typename S>
inline S directed(float x, bool up) {  // x rounded to S (nearest-even), then one step towards +-inf if needed
  S y = static_cast<S>(x);
  const float yf = static_cast<float>(y);
  if (up ? yf < x : yf > x)
    y = std::nextafter(y, static_cast<S>(up ? std::numeric_limits<float>::infinity() : NINF));
  return y;
}

template <>
inline float directed<float>(float x, bool) { return x; }

template <typename S>
bool quantize_rows(const float* x, int64_t rows, int64_t D, int64_t G, int bits, uint8_t* codes, S* scale,
                   S* offset) {
  const int64_t NG = D / G, per = 8 / bits, P = D / per;
  const float levels = static_cast<float>((1 << bits) - 1);
  bool finite = true;
  std::vector<uint8_t> q(D);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    for (int64_t g = 0; g < NG; ++g) {
      const float* xg = xr + g * G;
      float lo = xg[0], hi = xg[0];
      bool nan = false;
      for (int64_t c = 0; c < G; ++c) {
        const float v = xg[c];
        nan |= v != v;
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
      const S o = directed<S>(lo, false);
      const float of = static_cast<float>(o);
      const S sc = directed<S>(std::max(hi - of, 0.0f) / levels, true);
      const float sf = static_cast<float>(sc);
      finite &= !nan && std::isfinite(of) && std::isfinite(sf);
      scale[r * NG + g] = sc;
      offset[r * NG + g] = o;
      const float div = sf > 0.0f ? sf : 1.0f;
      for (int64_t c = 0; c < G; ++c) {
        const float v = std::nearbyint((xg[c] - of) / div);
        q[g * G + c] = static_cast<uint8_t>(v > 0.0f ? std::min(v, levels) : 0.0f);  // NaN: 0 (refused anyway)
      }
    }
    uint8_t* cr = codes + r * P;
    for (int64_t j = 0; j < P; ++j) {
      unsigned b = 0;
      for (int64_t i = 0; i < per; ++i) b |= static_cast<unsigned>(q[i * P + j]) << (i * bits);
      cr[j] = static_cast<uint8_t>(b);
    }
  }
  return finite;
}

}  // namespace

// x [B, H, t, D] -> (codes uint8 [B, H, t, D * bits / 8], scale and offset [B, H, t, D / G] in the scale
// dtype (scale_kind 0: float32, 1: float16, 2: bfloat16), whether every scale and offset is finite)
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> quantize_tokens_packed(const at::Tensor& x_, int64_t bits,
                                                                          int64_t group, int64_t scale_kind) {
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, "quantize_tokens_packed: bits must be 1, 2, 4 or 8");
  TORCH_CHECK(x_.dim() == 4 && x_.device().is_cpu(), "quantize_tokens_packed: x [B, H, t, D] on the CPU");
  const at::Tensor x = x_.to(at::kFloat).contiguous();
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  TORCH_CHECK(group > 0 && D % group == 0 && D % (8 / bits) == 0, "quantize_tokens_packed: bad group");
  const auto sdt = scale_kind == 1 ? at::kHalf : scale_kind == 2 ? at::kBFloat16 : at::kFloat;
  at::Tensor codes = at::empty({B, H, T, D * bits / 8}, x.options().dtype(at::kByte));
  at::Tensor scale = at::empty({B, H, T, D / group}, x.options().dtype(sdt));
  at::Tensor offset = at::empty_like(scale);
  const float* xp = x.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  const int64_t rows = B * H * T, NG = D / group, P = D * bits / 8;
  const int b = static_cast<int>(bits);
  std::atomic<bool> finite{true};
  auto run = [&](auto* sc, auto* of) {  // rows are independent: a prefill chunk uses every thread
    at::parallel_for(0, rows, 256, [&](int64_t r0, int64_t r1) {
      if (!quantize_rows(xp + r0 * D, r1 - r0, D, group, b, cp + r0 * P, sc + r0 * NG, of + r0 * NG))
        finite = false;
    });
  };
  if (sdt == at::kHalf)
    run(scale.data_ptr<c10::Half>(), offset.data_ptr<c10::Half>());
  else if (sdt == at::kBFloat16)
    run(scale.data_ptr<c10::BFloat16>(), offset.data_ptr<c10::BFloat16>());
  else
    run(scale.data_ptr<float>(), offset.data_ptr<float>());
  return {codes, scale, offset, finite.load()};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_decode", &quant_decode, "fused decode attention over packed KIVI / PM-KVQ storage (CPU)");
  m.def("paged_decode", &paged_decode, "paged sparse decode attention over selected slots (CPU, fp32)");
  m.def("page_select", &page_select, "Quest's page bounds and top-k pages with their slots (CPU, fp32)");
  m.def("page_marks_match", &page_marks_match, "whether summarised pages still start/end where they did");
  m.def("quantize_tokens_packed", &quantize_tokens_packed,
        "per-token group quantization + planar packing (KIVI values at a decode step; CPU)");
}
