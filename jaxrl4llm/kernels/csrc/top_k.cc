// Top-k on CPU: the k largest entries of each row of x [N, V] f32, in descending order, and their
// indices; ties go to the lower index, and floats compare in IEEE total order (-NaN < -inf < ...
// < -0 < +0 < ... < +inf < +NaN). That is what `jax.lax.top_k` returns, computed without sorting
// the row, in two vectorised passes:
//
//   1. the row is cut into ~4k disjoint sets (lane i of a run of g consecutive 16-vectors);
//      tau = the k-th largest of their maxima. k distinct entries are >= tau, so every top-k
//      entry is >= tau (for normal logits only ~k entries are);
//   2. the entries >= tau are selected and sorted.
//
// Operands: x [N, V] f32. Results: values [N, k] f32, indices [N, k] s32 (1 <= k <= V).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxrl4llm {
namespace {

// Signed integer with the float's total order.
inline int32_t order_key(float x) {
  const int32_t i = int32_t(float_to_bits(x));
  return i ^ ((i >> 31) & 0x7FFFFFFF);
}
inline i32x16 order_keys(const float* x) {
  i32x16 keys;
  std::memcpy(&keys, x, sizeof keys);
  return keys ^ ((keys >> 31) & 0x7FFFFFFF);
}

// Bit i set iff order_key(x[i]) >= threshold, for the 16 entries x[0..15].
inline uint32_t at_least_mask(const float* x, int32_t threshold) {
#if defined(__AVX512F__)
  __m512i keys = _mm512_loadu_si512(x);
  keys = _mm512_xor_si512(keys, _mm512_and_si512(_mm512_srai_epi32(keys, 31), _mm512_set1_epi32(0x7FFFFFFF)));
  return _mm512_cmpge_epi32_mask(keys, _mm512_set1_epi32(threshold));
#elif defined(__AVX2__)
  uint32_t mask = 0;
  const __m256i below = _mm256_set1_epi32(threshold);
  for (int half = 0; half < 2; ++half) {
    __m256i keys = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * half));
    keys = _mm256_xor_si256(keys, _mm256_and_si256(_mm256_srai_epi32(keys, 31), _mm256_set1_epi32(0x7FFFFFFF)));
    const __m256i less = _mm256_cmpgt_epi32(below, keys);
    mask |= (~uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(less))) & 0xFFu) << (8 * half);
  }
  return mask;
#else
  uint32_t mask = 0;
  for (int i = 0; i < kLanes; ++i) mask |= uint32_t(order_key(x[i]) >= threshold) << i;
  return mask;
#endif
}

struct Entry {
  int32_t key;
  int32_t index;
};

// Larger key first; lower index first among equal keys.
inline bool before(const Entry& a, const Entry& b) { return a.key > b.key || (a.key == b.key && a.index < b.index); }

struct Scratch {
  std::vector<int32_t> maxima;
  std::vector<Entry> candidates;
};

// A lower bound on the k-th largest key of x[0..v) (pass 1 above).
int32_t threshold_for(const float* x, int64_t v, int64_t k, std::vector<int32_t>& maxima) {
  const int64_t g = std::max<int64_t>(1, v / (4 * k));  // vectors per run: ~v / g = 4k sets (>= k)
  const int64_t run = g * kLanes, runs = v / run;
  maxima.resize(runs * kLanes);
  for (int64_t r = 0; r < runs; ++r) {
    const float* p = x + r * run;
    i32x16 best = order_keys(p);
    for (int64_t i = 1; i < g; ++i) {
      const i32x16 keys = order_keys(p + i * kLanes);
      best = keys > best ? keys : best;
    }
    std::memcpy(maxima.data() + r * kLanes, &best, sizeof best);
  }
  for (int64_t j = runs * run; j < v; ++j) maxima.push_back(order_key(x[j]));  // sets of one entry
  std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<int32_t>());
  return maxima[k - 1];
}

void top_k_row(const float* x, int64_t v, int64_t k, Scratch& scratch, float* values, int32_t* indices) {
  const int32_t tau = threshold_for(x, v, k, scratch.maxima);
  auto& candidates = scratch.candidates;
  candidates.clear();
  int64_t j = 0;
  for (; j + kLanes <= v; j += kLanes)
    for (uint32_t hits = at_least_mask(x + j, tau); hits != 0; hits &= hits - 1) {
      const int64_t at = j + __builtin_ctz(hits);
      candidates.push_back({order_key(x[at]), int32_t(at)});
    }
  for (; j < v; ++j)
    if (const int32_t key = order_key(x[j]); key >= tau) candidates.push_back({key, int32_t(j)});
  std::nth_element(candidates.begin(), candidates.begin() + (k - 1), candidates.end(), before);
  std::sort(candidates.begin(), candidates.begin() + k, before);
  for (int64_t i = 0; i < k; ++i) {
    values[i] = x[candidates[i].index];
    indices[i] = candidates[i].index;
  }
}

ffi::Error top_k(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::F32>> values,
                 ffi::Result<ffi::Buffer<ffi::S32>> indices) {
  auto xd = x.dimensions();
  auto vd = values->dimensions();
  auto id = indices->dimensions();
  if (xd.size() != 2 || vd.size() != 2 || id.size() != 2 || vd[0] != xd[0] || id[0] != xd[0] || id[1] != vd[1])
    return ffi::Error::InvalidArgument("top_k: expected x [N, V], values and indices [N, k]");
  const int64_t n = xd[0], v = xd[1], k = vd[1];
  if (k < 1 || k > v) return ffi::Error::InvalidArgument("top_k: need 1 <= k <= V");
  if (v > INT32_MAX) return ffi::Error::InvalidArgument("top_k: V must fit in int32");
  const float* xp = x.typed_data();
  float* vp = values->typed_data();
  int32_t* ip = indices->typed_data();
  parallel_for(pool, n, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t r = begin; r < end; ++r) top_k_row(xp + r * v, v, k, scratch, vp + r * k, ip + r * k);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxrl4llm

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxrl4llm_top_k, jaxrl4llm::top_k,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    // x
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()    // values
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());  // indices
