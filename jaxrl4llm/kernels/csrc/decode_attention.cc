// Decode attention on CPU: one query token per row against its prompt's KV and its own
// generated KV, for all rows and kv heads of one layer in one call.
//
//   out[n, k, h] = softmax_s(q[n, k, h] . K[s] / sqrt(Dh)) V[s]   over the prompt slots that are
//                  real, the sealed blocks, and slots 0..slot of the block being filled
//
// The same math and layouts as `models/decode.py: _decode_attention` (which XLA runs as many
// tiny batched matmuls); the numerics follow it too: with a bfloat16 cache the query and the
// probabilities are rounded to bfloat16 before their products, which accumulate in float32.
//
// Operands (Dh = head dim, G = N / P rows per prompt):
//   q          [N, KVH, HG, Dh] f32     prompt_k [P, KVH, Dh, T]   prompt_v [P, KVH, T, Dh]
//   prompt_mask [P, T] s32 (1 = real)   cur_k, cur_v [N, KVH, blk, Dh]   slot [] s32
//   then for each sealed block: keys [N, KVH, Dh, blk], values [N, KVH, blk, Dh]
// Cache operands are all bf16 or all f32. Result: [N, KVH, HG, Dh] f32.
//
// Pair layout (bf16, CPUs with AVX512-BF16; `jaxrl4llm_bf16_pairs()` returns 1 when built with
// it): prompt and sealed operands hold adjacent pairs of the contracted index side by side,
//   prompt_k [P, KVH, Dh/2, T, 2]   prompt_v [P, KVH, T/2, Dh, 2]   (T even)
//   sealed keys [N, KVH, Dh/2, blk, 2]   sealed values [N, KVH, blk/2, Dh, 2]
// so one VDPBF16PS multiplies 32 bf16 pairs into 16 float32 sums, with no conversion.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxrl4llm {
namespace {

struct Shape {
  int64_t n, kvh, hg, dh, prompts, t, blk, sealed;
};

constexpr float kMasked = -1e30f;
constexpr int kHeadGroup = 4;  // query heads per register block: kHeadGroup accumulators live in registers

// Columns [j0, j0 + 16 C) of s[h, :] = q[h] . K[:, :] for h < NH, keys stored [Dh, S]. NH * C * 2
// independent accumulators (even and odd d) keep the FMA pipes busy despite their latency.
template <int NH, int C, typename T>
void score_columns(const float* q, int64_t dh, const T* k, int64_t s_len, int64_t j0, float* out, int64_t stride) {
  f32x16 even[NH][C] = {}, odd[NH][C] = {};
  int64_t d = 0;
  for (; d + 1 < dh; d += 2) {
    for (int c = 0; c < C; ++c) {
      const f32x16 k0 = load16(k + d * s_len + j0 + c * kLanes), k1 = load16(k + (d + 1) * s_len + j0 + c * kLanes);
      for (int h = 0; h < NH; ++h) {
        even[h][c] += q[h * dh + d] * k0;
        odd[h][c] += q[h * dh + d + 1] * k1;
      }
    }
  }
  for (; d < dh; ++d)
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < NH; ++h) even[h][c] += q[h * dh + d] * load16(k + d * s_len + j0 + c * kLanes);
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) store16(out + h * stride + j0 + c * kLanes, even[h][c] + odd[h][c]);
}

// s[h, j] = q[h] . K[:, j] for h < NH, keys stored [Dh, S] (dimension-major), j < s_len.
template <int NH, typename T>
void scores_dim_major(const float* q, int64_t dh, const T* k, int64_t s_len, float* out, int64_t stride) {
  int64_t j0 = 0;
  for (; j0 + 4 * kLanes <= s_len; j0 += 4 * kLanes) score_columns<NH, 4>(q, dh, k, s_len, j0, out, stride);
  for (; j0 + kLanes <= s_len; j0 += kLanes) score_columns<NH, 1>(q, dh, k, s_len, j0, out, stride);
  for (int64_t j = j0; j < s_len; ++j)
    for (int h = 0; h < NH; ++h) {
      float acc = 0.0f;
      for (int64_t d = 0; d < dh; ++d) acc += q[h * dh + d] * load(k, d * s_len + j);
      out[h * stride + j] = acc;
    }
}

// s[h, j] = q[h] . K[j, :] for h < NH, keys stored [S, Dh] (slot-major), j < count.
template <int NH, typename T>
void scores_slot_major(const float* q, int64_t dh, const T* k, int64_t count, float* out, int64_t stride) {
  for (int64_t j = 0; j < count; ++j) {
    const T* key = k + j * dh;
    for (int h = 0; h < NH; ++h) {
      const float* qh = q + h * dh;
      f32x16 acc = {};
      int64_t d = 0;
      for (; d + kLanes <= dh; d += kLanes) acc += load16(qh + d) * load16(key + d);
      float total = sum16(acc);
      for (; d < dh; ++d) total += qh[d] * load(key, d);
      out[h * stride + j] = total;
    }
  }
}

// o[h, c0 : c0 + 16 C] += sum_{j < count} p[h, j] V[j, c0 : c0 + 16 C] for h < NH, values stored
// [S, Dh]; NH * C * 2 independent accumulators (even and odd j).
template <int NH, int C, typename T>
void value_columns(const float* p, int64_t stride, const T* v, int64_t dh, int64_t count, int64_t c0, float* o) {
  f32x16 even[NH][C], odd[NH][C] = {};
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) even[h][c] = load16(o + h * dh + c0 + c * kLanes);
  int64_t j = 0;
  for (; j + 1 < count; j += 2) {
    for (int c = 0; c < C; ++c) {
      const f32x16 v0 = load16(v + j * dh + c0 + c * kLanes), v1 = load16(v + (j + 1) * dh + c0 + c * kLanes);
      for (int h = 0; h < NH; ++h) {
        even[h][c] += p[h * stride + j] * v0;
        odd[h][c] += p[h * stride + j + 1] * v1;
      }
    }
  }
  for (; j < count; ++j)
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < NH; ++h) even[h][c] += p[h * stride + j] * load16(v + j * dh + c0 + c * kLanes);
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) store16(o + h * dh + c0 + c * kLanes, even[h][c] + odd[h][c]);
}

// o[h, :] += sum_{j < count} p[h, j] V[j, :] for h < NH, values stored [S, Dh].
template <int NH, typename T>
void weighted_values(const float* p, int64_t stride, const T* v, int64_t dh, int64_t count, float* o) {
  int64_t c = 0;
  for (; c + 4 * kLanes <= dh; c += 4 * kLanes) value_columns<NH, 4>(p, stride, v, dh, count, c, o);
  for (; c + kLanes <= dh; c += kLanes) value_columns<NH, 1>(p, stride, v, dh, count, c, o);
  for (; c < dh; ++c)
    for (int h = 0; h < NH; ++h) {
      float acc = o[h * dh + c];
      for (int64_t j = 0; j < count; ++j) acc += p[h * stride + j] * load(v, j * dh + c);
      o[h * dh + c] = acc;
    }
}

// x[j] = mask[j] ? x[j] * scale : kMasked (mask may be null: all real); returns max_j x[j].
inline float scale_mask_max(float* x, const int32_t* mask, int64_t count, float scale, float top) {
  int64_t j = 0;
  f32x16 best = splat(top);
  for (; j + kLanes <= count; j += kLanes) {
    f32x16 value = load16(x + j) * scale;
    if (mask != nullptr) {
      i32x16 m;
      std::memcpy(&m, mask + j, sizeof m);
      value = m != 0 ? value : splat(kMasked);
    }
    store16(x + j, value);
    best = value > best ? value : best;
  }
  for (int i = 0; i < kLanes; ++i) top = std::max(top, best[i]);
  for (; j < count; ++j) {
    x[j] = (mask == nullptr || mask[j] != 0) ? x[j] * scale : kMasked;
    top = std::max(top, x[j]);
  }
  return top;
}

// x = softmax(x) in place over `count` entries, rounded to bfloat16 if `round`.
inline void softmax(float* x, int64_t count, float top, bool round) {
  f32x16 total = {};
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) {
    const f32x16 e = exp_nonpositive(load16(x + j) - top);
    store16(x + j, e);
    total += e;
  }
  if (j < count) {  // the last count % 16 entries: one vector exp, padded with exp(-inf) = 0
    f32x16 tail = splat(kMasked);
    for (int64_t i = j; i < count; ++i) tail[i - j] = x[i];
    tail = exp_nonpositive(tail - top);
    for (int64_t i = j; i < count; ++i) x[i] = tail[i - j];
    total += tail;
  }
  const float sum = sum16(total);
  const float inv = 1.0f / sum;
  j = 0;
  for (; j + kLanes <= count; j += kLanes) {
    const f32x16 prob = load16(x + j) * inv;
    store16(x + j, round ? round_to_bf16(prob) : prob);
  }
  for (; j < count; ++j) x[j] = round ? round_to_bf16(x[j] * inv) : x[j] * inv;
}

template <typename T>
struct Operands {
  const float* q;
  const T *prompt_k, *prompt_v, *cur_k, *cur_v;
  const int32_t* mask;
  std::vector<const T*> sealed_k, sealed_v;
  float* out;
};

// One (row, kv head) item, query heads [h0, h0 + NH).
template <int NH, typename T>
void attend_heads(const Shape& sh, const Operands<T>& ops, int64_t item, int64_t h0, int64_t visible, float* q,
                  float* s, float* o) {
  constexpr bool kRound = sizeof(T) == 2;
  const int64_t n = item / sh.kvh, k = item % sh.kvh, prompt = n / (sh.n / sh.prompts);
  const int64_t width = sh.t + sh.sealed * sh.blk + sh.blk, cur = sh.t + sh.sealed * sh.blk;
  const int64_t pk = prompt * sh.kvh + k;
  const float* qi = ops.q + (item * sh.hg + h0) * sh.dh;
  for (int64_t i = 0; i < NH * sh.dh; ++i) q[i] = kRound ? round_to_bf16(qi[i]) : qi[i];
  scores_dim_major<NH>(q, sh.dh, ops.prompt_k + pk * sh.dh * sh.t, sh.t, s, width);
  for (int64_t b = 0; b < sh.sealed; ++b)
    scores_dim_major<NH>(q, sh.dh, ops.sealed_k[b] + item * sh.dh * sh.blk, sh.blk, s + sh.t + b * sh.blk, width);
  scores_slot_major<NH>(q, sh.dh, ops.cur_k + item * sh.blk * sh.dh, visible, s + cur, width);
  const float scale = 1.0f / std::sqrt(float(sh.dh));
  for (int h = 0; h < NH; ++h) {
    float* row = s + h * width;
    float top = scale_mask_max(row, ops.mask + prompt * sh.t, sh.t, scale, kMasked);
    top = scale_mask_max(row + sh.t, nullptr, cur - sh.t + visible, scale, top);
    softmax(row, cur + visible, top, kRound);
  }
  std::fill(o, o + NH * sh.dh, 0.0f);
  weighted_values<NH>(s, width, ops.prompt_v + pk * sh.t * sh.dh, sh.dh, sh.t, o);
  for (int64_t b = 0; b < sh.sealed; ++b)
    weighted_values<NH>(s + sh.t + b * sh.blk, width, ops.sealed_v[b] + item * sh.blk * sh.dh, sh.dh, sh.blk, o);
  weighted_values<NH>(s + cur, width, ops.cur_v + item * sh.blk * sh.dh, sh.dh, visible, o);
  std::copy(o, o + NH * sh.dh, ops.out + (item * sh.hg + h0) * sh.dh);
}

// f(std::integral_constant<int, NH>{}, item, h0) for items [begin, end) (item = (row, kv head)) and
// their query heads in groups [h0, h0 + NH) of at most kHeadGroup.
template <typename F>
void for_head_groups(const Shape& sh, int64_t begin, int64_t end, const F& f) {
  for (int64_t item = begin; item < end; ++item) {
    for (int64_t h0 = 0; h0 < sh.hg; h0 += kHeadGroup) {
      switch (std::min<int64_t>(kHeadGroup, sh.hg - h0)) {
        case 1: f(std::integral_constant<int, 1>{}, item, h0); break;
        case 2: f(std::integral_constant<int, 2>{}, item, h0); break;
        case 3: f(std::integral_constant<int, 3>{}, item, h0); break;
        default: f(std::integral_constant<int, kHeadGroup>{}, item, h0); break;
      }
    }
  }
}

template <typename T>
void attend(const Shape& sh, const Operands<T>& ops, int64_t slot, int64_t begin, int64_t end) {
  const int64_t width = sh.t + sh.sealed * sh.blk + sh.blk;  // score columns per head
  std::vector<float> q(kHeadGroup * sh.dh), s(kHeadGroup * width), o(kHeadGroup * sh.dh);
  for_head_groups(sh, begin, end, [&](auto nh, int64_t item, int64_t h0) {
    attend_heads<decltype(nh)::value>(sh, ops, item, h0, slot + 1, q.data(), s.data(), o.data());
  });
}

#if defined(__AVX512BF16__)
// ---------------------------------------------------------------------------- pair layout
inline uint32_t pair_at(const uint16_t* p, int64_t i) {  // elements i, i + 1 as one 32-bit lane
  uint32_t pair;
  std::memcpy(&pair, p + i, sizeof pair);
  return pair;
}

// s[h, j] = q[h] . K[:, j] for h < NH, j < s_len; keys [Dh/2, S, 2]; q [NH, Dh] bf16 bits (Dh even).
template <int NH>
void pair_scores(const uint16_t* q, int64_t dh, const uint16_t* k, int64_t s_len, float* out, int64_t stride) {
  const int64_t half = dh / 2;
  int64_t j0 = 0;
  for (; j0 + 4 * kLanes <= s_len; j0 += 4 * kLanes) {
    __m512 acc[NH][4];
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < 4; ++c) acc[h][c] = _mm512_setzero_ps();
    for (int64_t d2 = 0; d2 < half; ++d2) {
      __m512bh kv[4];
      for (int c = 0; c < 4; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + (d2 * s_len + j0 + c * kLanes) * 2);
      for (int h = 0; h < NH; ++h) {
        const __m512bh qq = (__m512bh)_mm512_set1_epi32(int32_t(pair_at(q, h * dh + 2 * d2)));
        for (int c = 0; c < 4; ++c) acc[h][c] = _mm512_dpbf16_ps(acc[h][c], qq, kv[c]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + h * stride + j0 + c * kLanes, acc[h][c]);
  }
  for (; j0 + kLanes <= s_len; j0 += kLanes) {
    __m512 acc[NH];
    for (int h = 0; h < NH; ++h) acc[h] = _mm512_setzero_ps();
    for (int64_t d2 = 0; d2 < half; ++d2) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + (d2 * s_len + j0) * 2);
      for (int h = 0; h < NH; ++h)
        acc[h] = _mm512_dpbf16_ps(acc[h], (__m512bh)_mm512_set1_epi32(int32_t(pair_at(q, h * dh + 2 * d2))), kv);
    }
    for (int h = 0; h < NH; ++h) _mm512_storeu_ps(out + h * stride + j0, acc[h]);
  }
  for (int64_t j = j0; j < s_len; ++j)
    for (int h = 0; h < NH; ++h) {
      float acc = 0.0f;
      for (int64_t d = 0; d < dh; ++d) acc += load(q, h * dh + d) * load(k, ((d / 2) * s_len + j) * 2 + d % 2);
      out[h * stride + j] = acc;
    }
}

// s[h, j] = q[h] . K[j, :] for h < NH, j < count; keys [S, Dh] (the block being filled).
template <int NH>
void pair_scores_slot_major(const uint16_t* q, int64_t dh, const uint16_t* k, int64_t count, float* out,
                            int64_t stride) {
  for (int64_t j = 0; j < count; ++j) {
    const uint16_t* key = k + j * dh;
    for (int h = 0; h < NH; ++h) {
      const uint16_t* qh = q + h * dh;
      __m512 acc = _mm512_setzero_ps();
      int64_t d = 0;
      for (; d + 2 * kLanes <= dh; d += 2 * kLanes)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qh + d), (__m512bh)_mm512_loadu_si512(key + d));
      float total = _mm512_reduce_add_ps(acc);
      for (; d < dh; ++d) total += load(qh, d) * load(key, d);
      out[h * stride + j] = total;
    }
  }
}

// o[h, c0 : c0 + 16 C] += sum_{j < count} p[h, j] V[j, c0 : ...] for h < NH; values [S/2, Dh, 2],
// count even; p [NH, stride] bf16 bits.
template <int NH, int C>
void pair_value_columns(const uint16_t* p, int64_t stride, const uint16_t* v, int64_t dh, int64_t count, int64_t c0,
                        float* o) {
  __m512 acc[NH][C];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = _mm512_loadu_ps(o + h * dh + c0 + c * kLanes);
  for (int64_t s2 = 0; s2 < count / 2; ++s2) {
    __m512bh vv[C];
    for (int c = 0; c < C; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(v + (s2 * dh + c0 + c * kLanes) * 2);
    for (int h = 0; h < NH; ++h) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(int32_t(pair_at(p, h * stride + 2 * s2)));
      for (int c = 0; c < C; ++c) acc[h][c] = _mm512_dpbf16_ps(acc[h][c], pp, vv[c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + h * dh + c0 + c * kLanes, acc[h][c]);
}

template <int NH>
void pair_values(const uint16_t* p, int64_t stride, const uint16_t* v, int64_t dh, int64_t count, float* o) {
  int64_t c = 0;
  for (; c + 4 * kLanes <= dh; c += 4 * kLanes) pair_value_columns<NH, 4>(p, stride, v, dh, count, c, o);
  for (; c + kLanes <= dh; c += kLanes) pair_value_columns<NH, 1>(p, stride, v, dh, count, c, o);
  for (; c < dh; ++c)
    for (int h = 0; h < NH; ++h) {
      float acc = o[h * dh + c];
      for (int64_t j = 0; j < count; ++j) acc += load(p, h * stride + j) * load(v, ((j / 2) * dh + c) * 2 + j % 2);
      o[h * dh + c] = acc;
    }
}

struct PairScratch {
  std::vector<uint16_t> q, p;
};

// One (row, kv head) item, query heads [h0, h0 + NH), pair layout.
template <int NH>
void attend_heads_pairs(const Shape& sh, const Operands<uint16_t>& ops, int64_t item, int64_t h0, int64_t visible,
                        PairScratch& pairs, float* s, float* o) {
  const int64_t n = item / sh.kvh, k = item % sh.kvh, prompt = n / (sh.n / sh.prompts);
  const int64_t width = sh.t + sh.sealed * sh.blk + sh.blk, cur = sh.t + sh.sealed * sh.blk;
  const int64_t pk = prompt * sh.kvh + k;
  const float* qi = ops.q + (item * sh.hg + h0) * sh.dh;
  uint16_t* q = pairs.q.data();
  for (int64_t i = 0; i < NH * sh.dh; ++i) q[i] = uint16_t(float_to_bits(round_to_bf16(qi[i])) >> 16);
  pair_scores<NH>(q, sh.dh, ops.prompt_k + pk * sh.dh * sh.t, sh.t, s, width);
  for (int64_t b = 0; b < sh.sealed; ++b)
    pair_scores<NH>(q, sh.dh, ops.sealed_k[b] + item * sh.dh * sh.blk, sh.blk, s + sh.t + b * sh.blk, width);
  pair_scores_slot_major<NH>(q, sh.dh, ops.cur_k + item * sh.blk * sh.dh, visible, s + cur, width);
  const float scale = 1.0f / std::sqrt(float(sh.dh));
  uint16_t* p = pairs.p.data();
  for (int h = 0; h < NH; ++h) {
    float* row = s + h * width;
    float top = scale_mask_max(row, ops.mask + prompt * sh.t, sh.t, scale, kMasked);
    top = scale_mask_max(row + sh.t, nullptr, cur - sh.t + visible, scale, top);
    softmax(row, cur + visible, top, true);
    for (int64_t j = 0; j < cur; ++j) p[h * width + j] = uint16_t(float_to_bits(row[j]) >> 16);
  }
  std::fill(o, o + NH * sh.dh, 0.0f);
  pair_values<NH>(p, width, ops.prompt_v + pk * sh.t * sh.dh, sh.dh, sh.t, o);
  for (int64_t b = 0; b < sh.sealed; ++b)
    pair_values<NH>(p + sh.t + b * sh.blk, width, ops.sealed_v[b] + item * sh.blk * sh.dh, sh.dh, sh.blk, o);
  weighted_values<NH>(s + cur, width, ops.cur_v + item * sh.blk * sh.dh, sh.dh, visible, o);
  std::copy(o, o + NH * sh.dh, ops.out + (item * sh.hg + h0) * sh.dh);
}

void attend_pairs(const Shape& sh, const Operands<uint16_t>& ops, int64_t slot, int64_t begin, int64_t end) {
  const int64_t width = sh.t + sh.sealed * sh.blk + sh.blk;
  std::vector<float> s(kHeadGroup * width), o(kHeadGroup * sh.dh);
  PairScratch pairs{std::vector<uint16_t>(kHeadGroup * sh.dh), std::vector<uint16_t>(kHeadGroup * width)};
  for_head_groups(sh, begin, end, [&](auto nh, int64_t item, int64_t h0) {
    attend_heads_pairs<decltype(nh)::value>(sh, ops, item, h0, slot + 1, pairs, s.data(), o.data());
  });
}
#endif  // __AVX512BF16__

ffi::Error check_dims(const ffi::AnyBuffer& b, std::initializer_list<int64_t> want, const char* name) {
  auto dims = b.dimensions();
  bool ok = dims.size() == want.size();
  for (size_t i = 0; ok && i < want.size(); ++i) ok = dims[i] == want.begin()[i];
  if (!ok) return ffi::Error::InvalidArgument(std::string("decode_attention: unexpected shape of ") + name);
  return ffi::Error::Success();
}

template <typename T>
ffi::Error run(ffi::ThreadPool pool, const Shape& sh, bool pairs, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer prompt_k,
               ffi::AnyBuffer prompt_v, ffi::Buffer<ffi::S32> mask, ffi::AnyBuffer cur_k, ffi::AnyBuffer cur_v,
               int64_t slot, ffi::RemainingArgs sealed, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto data = [](const ffi::AnyBuffer& b) { return reinterpret_cast<const T*>(b.untyped_data()); };
  Operands<T> ops{q.typed_data(), data(prompt_k), data(prompt_v), data(cur_k), data(cur_v), mask.typed_data(),
                  {}, {}, out->typed_data()};
  for (int64_t b = 0; b < sh.sealed; ++b) {
    auto kb = sealed.get<ffi::AnyBuffer>(2 * b), vb = sealed.get<ffi::AnyBuffer>(2 * b + 1);
    if (!kb.has_value() || !vb.has_value()) return ffi::Error::InvalidArgument("decode_attention: bad sealed block");
    if (pairs) {
      if (auto e = check_dims(*kb, {sh.n, sh.kvh, sh.dh / 2, sh.blk, 2}, "sealed keys"); e.failure()) return e;
      if (auto e = check_dims(*vb, {sh.n, sh.kvh, sh.blk / 2, sh.dh, 2}, "sealed values"); e.failure()) return e;
    } else {
      if (auto e = check_dims(*kb, {sh.n, sh.kvh, sh.dh, sh.blk}, "sealed keys"); e.failure()) return e;
      if (auto e = check_dims(*vb, {sh.n, sh.kvh, sh.blk, sh.dh}, "sealed values"); e.failure()) return e;
    }
    if (kb->element_type() != prompt_k.element_type() || vb->element_type() != prompt_k.element_type())
      return ffi::Error::InvalidArgument("decode_attention: cache operands must share one dtype");
    ops.sealed_k.push_back(data(*kb));
    ops.sealed_v.push_back(data(*vb));
  }
  const int64_t items = sh.n * sh.kvh;
  const int64_t grain = std::max<int64_t>(1, items / (8 * std::max<int64_t>(1, pool.num_threads() + 1)));
  parallel_for(pool, items, grain, [&](int64_t begin, int64_t end) {
#if defined(__AVX512BF16__)
    if constexpr (sizeof(T) == 2) {
      if (pairs) return attend_pairs(sh, ops, slot, begin, end);
    }
#endif
    attend<T>(sh, ops, slot, begin, end);
  });
  return ffi::Error::Success();
}

ffi::Error decode_attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer prompt_k,
                            ffi::AnyBuffer prompt_v, ffi::Buffer<ffi::S32> mask, ffi::AnyBuffer cur_k,
                            ffi::AnyBuffer cur_v, ffi::Buffer<ffi::S32> slot, ffi::RemainingArgs sealed,
                            ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto qd = q.dimensions();
  auto pkd = prompt_k.dimensions();
  auto ckd = cur_k.dimensions();
  const bool pairs = pkd.size() == 5;
  if (qd.size() != 4 || (pkd.size() != 4 && !pairs) || ckd.size() != 4)
    return ffi::Error::InvalidArgument("decode_attention: q and caches must be rank 4 (prompt/sealed: 5 in pairs)");
  if (sealed.size() % 2 != 0) return ffi::Error::InvalidArgument("decode_attention: sealed keys/values unpaired");
  Shape sh{qd[0], qd[1], qd[2], qd[3], pkd[0], pkd[3], ckd[2], int64_t(sealed.size() / 2)};
  if (sh.prompts <= 0 || sh.n % sh.prompts != 0)
    return ffi::Error::InvalidArgument("decode_attention: rows must be a multiple of prompts");
  auto type = prompt_k.element_type();
  if (pairs) {
#if !defined(__AVX512BF16__)
    return ffi::Error::InvalidArgument("decode_attention: the pair layout needs a build with AVX512-BF16");
#endif
    if (type != ffi::DataType::BF16 || sh.dh % 2 || sh.t % 2 || sh.blk % 2)
      return ffi::Error::InvalidArgument("decode_attention: the pair layout needs bf16 and even Dh, T and blk");
    if (auto e = check_dims(prompt_k, {sh.prompts, sh.kvh, sh.dh / 2, sh.t, 2}, "prompt keys"); e.failure()) return e;
    if (auto e = check_dims(prompt_v, {sh.prompts, sh.kvh, sh.t / 2, sh.dh, 2}, "prompt values"); e.failure())
      return e;
  } else {
    if (auto e = check_dims(prompt_k, {sh.prompts, sh.kvh, sh.dh, sh.t}, "prompt keys"); e.failure()) return e;
    if (auto e = check_dims(prompt_v, {sh.prompts, sh.kvh, sh.t, sh.dh}, "prompt values"); e.failure()) return e;
  }
  if (auto e = check_dims(cur_k, {sh.n, sh.kvh, sh.blk, sh.dh}, "current keys"); e.failure()) return e;
  if (auto e = check_dims(cur_v, {sh.n, sh.kvh, sh.blk, sh.dh}, "current values"); e.failure()) return e;
  if (prompt_v.element_type() != type || cur_k.element_type() != type || cur_v.element_type() != type)
    return ffi::Error::InvalidArgument("decode_attention: cache operands must share one dtype");
  const int64_t s = int64_t(slot.typed_data()[0]);
  if (s < 0 || s >= sh.blk) return ffi::Error::InvalidArgument("decode_attention: slot outside the block");
  if (type == ffi::DataType::BF16)
    return run<uint16_t>(pool, sh, pairs, q, prompt_k, prompt_v, mask, cur_k, cur_v, s, sealed, out);
  if (type == ffi::DataType::F32)
    return run<float>(pool, sh, pairs, q, prompt_k, prompt_v, mask, cur_k, cur_v, s, sealed, out);
  return ffi::Error::InvalidArgument("decode_attention: cache dtype must be bfloat16 or float32");
}

}  // namespace
}  // namespace jaxrl4llm

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxrl4llm_decode_attention, jaxrl4llm::decode_attention,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // q
                                  .Arg<xla::ffi::AnyBuffer>()              // prompt_k
                                  .Arg<xla::ffi::AnyBuffer>()              // prompt_v
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // prompt_mask
                                  .Arg<xla::ffi::AnyBuffer>()              // cur_k
                                  .Arg<xla::ffi::AnyBuffer>()              // cur_v
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // slot
                                  .RemainingArgs()                         // sealed k0, v0, k1, v1, ...
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

// 1 if this build has the pair layout (AVX512-BF16), else 0.
extern "C" int jaxrl4llm_bf16_pairs() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}
