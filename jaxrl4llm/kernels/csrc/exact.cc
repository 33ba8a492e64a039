// Batch-invariant CPU kernels of `model.numerics: exact` (kernels/exact.py): every output element
// is computed by one fixed sequence of float32 operations that depends only on that element's own
// inputs, never on how many rows the call has, where the row sits, or how threads split the work.
// The sampler (prefill, decode) and the trainer (packed rows) call the same kernels, so the same
// token gets the same bits in both.
//
//   matmul     y[m, n] = fma(x[m, K-1], w[K-1, n], ... fma(x[m, 0], w[0, n], 0))   k ascending
//   rms_inverse    y[m] = 1 / sqrt(sum(x[m]^2) / K + eps)
//   token_logprob  y[m] = (z[m, tok_m] - max z[m]) - log sum_k exp(z[m, k] - max z[m])
//   rope           cos, sin of angle = float(position) * inv_freq (libm), then x cos + rotate_half(x) sin
//                  with both products rounded before the sum (XLA:CPU contracts a * b + c into one
//                  fma where both sit in one fusion, and its fusions differ between programs)
//              sums: tree(p_0 .. p_7), p_l = sum_{k = l mod 8} a_k, k ascending; exp, log, sqrt: libm
//              (XLA:CPU's vectorised exp and log round differently from its scalar ones, so a row's
//              value would depend on where the row falls in a vector loop)
//   attention  out[b, t, h] = sum_j p_j v_j / sum_j p_j,  p_j = exp(s_j - max s),  s_j = dot(q, k_j) * scale
//              over the keys of two ranges of row b, in order (j ascending); dot = row_sum's order over Dh
//
// std::fma is exactly rounded, so its vectorised and scalar forms give the same bits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxrl4llm {
namespace {

constexpr int64_t kTileCols = 32;  // output columns a matmul tile keeps in accumulators
constexpr int64_t kTileRows = 4;   // rows a matmul tile shares each weight load with

// y[m0 .. m0+R, n0 .. n0+C] for R rows and C <= kTileCols columns; each element its own fma chain.
template <int R>
void matmul_tile(const float* x, const float* w, float* y, int64_t k, int64_t n, int64_t n0, int64_t cols) {
  float acc[R][kTileCols] = {};
  if (cols == kTileCols) {
    for (int64_t kk = 0; kk < k; ++kk) {
      const float* wk = w + kk * n + n0;
      for (int r = 0; r < R; ++r) {
        const float xv = x[r * k + kk];
#pragma GCC unroll 32
        for (int c = 0; c < kTileCols; ++c) acc[r][c] = std::fma(xv, wk[c], acc[r][c]);
      }
    }
  } else {
    for (int64_t kk = 0; kk < k; ++kk) {
      const float* wk = w + kk * n + n0;
      for (int r = 0; r < R; ++r) {
        const float xv = x[r * k + kk];
        for (int64_t c = 0; c < cols; ++c) acc[r][c] = std::fma(xv, wk[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < cols; ++c) y[r * n + n0 + c] = acc[r][c];
}

void matmul_panel(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n, int64_t n0) {
  const int64_t cols = std::min(kTileCols, n - n0);
  int64_t m0 = 0;
  for (; m0 + kTileRows <= m; m0 += kTileRows) matmul_tile<kTileRows>(x + m0 * k, w, y + m0 * n, k, n, n0, cols);
  for (; m0 < m; ++m0) matmul_tile<1>(x + m0 * k, w, y + m0 * n, k, n, n0, cols);
}

ffi::Error matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("exact matmul: expected x [M, K] and w [K, N]");
  const int64_t m = xd[0], k = xd[1], n = wd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t panels = (n + kTileCols - 1) / kTileCols;
  parallel_for(pool, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) matmul_panel(xp, wp, yp, m, k, n, p * kTileCols);
  });
  return ffi::Error::Success();
}

// sum of a[0 .. len) in the fixed order of the header: eight strided partial sums, then a tree.
__attribute__((noinline)) float fixed_sum(const float* a, int64_t len) {
  float p[8] = {};
  int64_t i = 0;
  for (; i + 8 <= len; i += 8)
    for (int l = 0; l < 8; ++l) p[l] += a[i + l];
  for (int l = 0; i + l < len; ++l) p[l] += a[i + l];
  return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

// dot(a, b) over len in fixed_sum's order (each product rounded, then summed).
__attribute__((noinline)) float fixed_dot(const float* a, const float* b, int64_t len) {
  float p[8] = {};
  int64_t i = 0;
  for (; i + 8 <= len; i += 8)
    for (int l = 0; l < 8; ++l) p[l] += a[i + l] * b[i + l];
  for (int l = 0; i + l < len; ++l) p[l] += a[i + l] * b[i + l];
  return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

ffi::Error rms_inverse(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, float eps,
                       ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("exact rms_inverse: expected x [M, K]");
  const int64_t m = xd[0], k = xd[1];
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  parallel_for(pool, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float variance = fixed_dot(xp + r * k, xp + r * k, k) / static_cast<float>(k);
      yp[r] = 1.0f / std::sqrt(variance + eps);
    }
  });
  return ffi::Error::Success();
}

ffi::Error token_logprob(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> tokens,
                         ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || tokens.dimensions().size() != 1 || tokens.dimensions()[0] != xd[0])
    return ffi::Error::InvalidArgument("exact token_logprob: expected z [M, V] and tokens [M]");
  const int64_t m = xd[0], k = xd[1];
  const float* xp = x.typed_data();
  const int32_t* tp = tokens.typed_data();
  float* yp = y->typed_data();
  parallel_for(pool, m, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> shifted(k);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * k;
      float top = row[0];
      for (int64_t i = 1; i < k; ++i) top = std::max(top, row[i]);
      for (int64_t i = 0; i < k; ++i) shifted[i] = std::exp(row[i] - top);
      const int64_t token = std::min<int64_t>(std::max<int64_t>(tp[r], 0), k - 1);
      const float picked = row[token] - top;
      yp[r] = picked - std::log(fixed_sum(shifted.data(), k));
    }
  });
  return ffi::Error::Success();
}

ffi::Error rope_tables(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> inv_freq,
                       ffi::Result<ffi::Buffer<ffi::F32>> cosines, ffi::Result<ffi::Buffer<ffi::F32>> sines) {
  if (positions.dimensions().size() != 1 || inv_freq.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("exact rope_tables: expected positions [M], inv_freq [Dh/2]");
  const int64_t m = positions.dimensions()[0], half = inv_freq.dimensions()[0];
  const int32_t* pp = positions.typed_data();
  const float* fp = inv_freq.typed_data();
  float* cp = cosines->typed_data();
  float* sp = sines->typed_data();
  parallel_for(pool, m, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(pp[r]) * fp[i];
        cp[r * 2 * half + i] = cp[r * 2 * half + half + i] = std::cos(angle);
        sp[r * 2 * half + i] = sp[r * 2 * half + half + i] = std::sin(angle);
      }
  });
  return ffi::Error::Success();
}

// x cos + rotate_half(x) sin of one head, each product rounded before the sum.
__attribute__((noinline)) void rotate(const float* x, const float* c, const float* s, int64_t dh, float* out) {
  const int64_t half = dh / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    const float ac = a * c[i], bs = b * s[i], bc = b * c[i + half], as = a * s[i + half];
    out[i] = ac - bs;
    out[i + half] = bc + as;
  }
}

ffi::Error apply_rope(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> cosines,
                      ffi::Buffer<ffi::F32> sines, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto xd = x.dimensions();
  auto cd = cosines.dimensions();
  if (xd.size() != 3 || cd.size() != 2 || cd[0] != xd[0] || cd[1] != xd[2] || xd[2] % 2)
    return ffi::Error::InvalidArgument("exact apply_rope: expected x [M, N, Dh], cos and sin [M, Dh]");
  const int64_t m = xd[0], n = xd[1], dh = xd[2];
  const float* xp = x.typed_data();
  const float* cp = cosines.typed_data();
  const float* sp = sines.typed_data();
  float* op = out->typed_data();
  parallel_for(pool, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t h = 0; h < n; ++h) rotate(xp + (r * n + h) * dh, cp + r * dh, sp + r * dh, dh, op + (r * n + h) * dh);
  });
  return ffi::Error::Success();
}

// One query head against the keys of [a0, a1) then [b0, b1) of its row (key rows of S x KVH x Dh).
__attribute__((noinline)) void attend_one(const float* q, const float* keys, const float* values, int64_t kvh,
                                          int64_t dh, const int32_t* range, float scale, float* scores, float* out) {
  int64_t count = 0;
  for (int part = 0; part < 2; ++part)
    for (int64_t s = range[2 * part]; s < range[2 * part + 1]; ++s)
      scores[count++] = fixed_dot(q, keys + s * kvh * dh, dh) * scale;
  for (int64_t d = 0; d < dh; ++d) out[d] = 0.0f;
  if (count == 0) return;
  float top = scores[0];
  for (int64_t j = 1; j < count; ++j) top = std::max(top, scores[j]);
  float total = 0.0f;
  int64_t j = 0;
  for (int part = 0; part < 2; ++part)
    for (int64_t s = range[2 * part]; s < range[2 * part + 1]; ++s, ++j) {
      const float p = std::exp(scores[j] - top);
      total += p;
      const float* v = values + s * kvh * dh;
      for (int64_t d = 0; d < dh; ++d) out[d] = std::fma(p, v[d], out[d]);
    }
  for (int64_t d = 0; d < dh; ++d) out[d] = out[d] / total;
}

ffi::Error attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                     ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> ranges, float scale,
                     ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto rd = ranges.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || rd.size() != 3 || rd[2] != 4 || kd[0] != qd[0] || rd[0] != qd[0] ||
      rd[1] != qd[1] || kd[3] != qd[3] || qd[2] % kd[2] || v.dimensions().size() != 4 ||
      v.dimensions()[0] != kd[0] || v.dimensions()[1] != kd[1] || v.dimensions()[2] != kd[2] ||
      v.dimensions()[3] != kd[3])
    return ffi::Error::InvalidArgument(
        "exact attention: expected q [B, T, H, Dh], k and v [B, S, KVH, Dh] (H a multiple of KVH), "
        "ranges [B, T, 4]");
  const int64_t b = qd[0], t = qd[1], h = qd[2], dh = qd[3], s = kd[1], kvh = kd[2], group = h / kvh;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const int32_t* rp = ranges.typed_data();
  float* op = out->typed_data();
  for (int64_t i = 0; i < b * t; ++i) {
    const int32_t* r = rp + i * 4;
    if (r[0] < 0 || r[0] > r[1] || r[1] > s || r[2] < 0 || r[2] > r[3] || r[3] > s)
      return ffi::Error::InvalidArgument("exact attention: a key range lies outside [0, S) or ends before it starts");
  }
  parallel_for(pool, b * t, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(2 * s + 1);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / t;
      const float* keys = kp + row * s * kvh * dh;
      const float* values = vp + row * s * kvh * dh;
      for (int64_t head = 0; head < h; ++head) {
        const int64_t kv = head / group;
        attend_one(qp + (i * h + head) * dh, keys + kv * dh, values + kv * dh, kvh, dh, rp + i * 4, scale,
                   scores.data(), op + (i * h + head) * dh);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxrl4llm

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxrl4llm_exact_matmul, jaxrl4llm::matmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // x [M, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // w [K, N]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxrl4llm_exact_rms_inverse, jaxrl4llm::rms_inverse,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // x [M, K]
                                  .Attr<float>("eps")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // y [M]

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxrl4llm_exact_token_logprob, jaxrl4llm::token_logprob,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // z [M, V]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // tokens [M]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // y [M]

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxrl4llm_exact_rope_tables, jaxrl4llm::rope_tables,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // positions [M]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // inv_freq [Dh/2]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // cos [M, Dh]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // sin [M, Dh]

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxrl4llm_exact_apply_rope, jaxrl4llm::apply_rope,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // x [M, N, Dh]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // cos [M, Dh]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // sin [M, Dh]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // out [M, N, Dh]

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxrl4llm_exact_attention, jaxrl4llm::attention,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // q [B, T, H, Dh]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // k [B, S, KVH, Dh]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // v [B, S, KVH, Dh]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // ranges [B, T, 4]
                                  .Attr<float>("scale")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // out [B, T, H, Dh]
