// Paged decode attention on CPU: write each slot's new token into the page pool, then one query
// per slot against its live pages, read in place through its page table.
//
//   pool[d, write_page[d, s], write_offset[d, s]] = interleave(k_new[d, s], v_new[d, s])
//   out[d, s, k, h] = softmax_j(q[d, s, k, h] . K[j] / sqrt(Dh)) V[j]   over the kv_len[d, s]
//                     tokens of slot s: token j at pool[d, table[d, s, j / page], j % page]
//
// The same math as `sampling/paged_cache.py: paged_attention` (XLA): scores and softmax in
// float32; with a 16-bit pool the query and the normalised probabilities are rounded to
// bfloat16 before their products, which accumulate in float32. An idle slot (kv_len 0) gets 0.
//
// Operands (pool: keys and values interleaved on the head axis, key of head k at 2k, value at 2k+1):
//   q [D, S, KVH, HG, Dh] f32      pool [D, P, page, 2 KVH, Dh] bf16 (or its uint16 bits) or f32
//   k_new, v_new [D, S, KVH, Dh] (the pool's dtype)   write_page, write_offset [D, S] s32
//   table [D, S, W] s32            kv_len [D, S] s32
// Results: out [D, S, KVH, HG, Dh] f32, and the pool (aliased to the operand: written in place).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "parallel.h"
#include "vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxrl4llm {
namespace {

constexpr int kMaxHeads = 4;  // query heads per register block

struct PagedShape {
  int64_t d, s, kvh, hg, dh, pages, page, width;
};

// The 16 lane sums of v[0..15] as one vector: out[j] = sum_l v[j][l]. A tree of shuffles and adds
// (16 -> 8 -> 4 -> 2 -> 1 partial sums per vector) leaves token j in lane bitreverse4(j).
inline f32x16 lane_sums(const f32x16* v) {
  f32x16 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const f32x16 z = __builtin_shufflevector(y[0], y[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                   __builtin_shufflevector(y[0], y[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  return __builtin_shufflevector(z, z, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

// s[h, j] = q[h] . key[j] for h < NH, j < count (key[j]: Dh contiguous values), 16 tokens at a
// time: 16 vectors of lane-wise partial products, then their lane sums in one tree.
template <int NH, typename T>
void scores(const float* q, int64_t dh, const T* const* key, int64_t count, float* s, int64_t s_stride) {
  const int64_t full = dh - dh % kLanes;
  for (int64_t j0 = 0; j0 < count; j0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, count - j0);
    for (int h = 0; h < NH; ++h) {
      const float* qh = q + h * dh;
      f32x16 acc[kLanes] = {};
      for (int64_t e = 0; e < full; e += kLanes) {
        const f32x16 qe = load16(qh + e);
        for (int64_t j = 0; j < n; ++j) acc[j] += qe * load16(key[j0 + j] + e);
      }
      f32x16 sums = lane_sums(acc);
      for (int64_t e = full; e < dh; ++e)
        for (int64_t j = 0; j < n; ++j) sums[j] += qh[e] * load(key[j0 + j], e);
      for (int64_t j = 0; j < n; ++j) s[h * s_stride + j0 + j] = sums[j];
    }
  }
}

// o[h, c0 : c0 + 16 C] += sum_{j < count} p[h, j] value[j][c0 : ...] for h < NH; NH * C accumulators.
template <int NH, int C, typename T>
void value_block(const float* p, int64_t p_stride, const T* const* value, int64_t dh, int64_t count, int64_t c0,
                 float* o) {
  f32x16 acc[NH][C];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = load16(o + h * dh + c0 + c * kLanes);
  for (int64_t j = 0; j < count; ++j) {
    f32x16 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(value[j] + c0 + c * kLanes);
    for (int h = 0; h < NH; ++h) {
      const float pj = p[h * p_stride + j];
      for (int c = 0; c < C; ++c) acc[h][c] += pj * v[c];
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) store16(o + h * dh + c0 + c * kLanes, acc[h][c]);
}

// o[h, :] += sum_{j < count} p[h, j] value[j] for h < NH.
template <int NH, typename T>
void weighted_values(const float* p, int64_t p_stride, const T* const* value, int64_t dh, int64_t count, float* o) {
  int64_t c = 0;
  for (; c + 4 * kLanes <= dh; c += 4 * kLanes) value_block<NH, 4>(p, p_stride, value, dh, count, c, o);
  for (; c + kLanes <= dh; c += kLanes) value_block<NH, 1>(p, p_stride, value, dh, count, c, o);
  for (; c < dh; ++c)
    for (int h = 0; h < NH; ++h) {
      float acc = o[h * dh + c];
      for (int64_t j = 0; j < count; ++j) acc += p[h * p_stride + j] * load(value[j], c);
      o[h * dh + c] = acc;
    }
}

// x = softmax(x * scale) in place over `count` entries (all valid), rounded to bfloat16 if `round`.
inline void scaled_softmax(float* x, int64_t count, float scale, bool round) {
  f32x16 best = splat(-1e30f);
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) {
    const f32x16 value = load16(x + j) * scale;
    store16(x + j, value);
    best = value > best ? value : best;
  }
  float top = -1e30f;
  for (int i = 0; i < kLanes; ++i) top = std::max(top, best[i]);
  for (; j < count; ++j) {
    x[j] *= scale;
    top = std::max(top, x[j]);
  }
  f32x16 total = {};
  j = 0;
  for (; j + kLanes <= count; j += kLanes) {
    const f32x16 e = exp_nonpositive(load16(x + j) - top);
    store16(x + j, e);
    total += e;
  }
  if (j < count) {
    f32x16 tail = splat(-1e30f);
    for (int64_t i = j; i < count; ++i) tail[i - j] = x[i];
    tail = exp_nonpositive(tail - top);
    for (int64_t i = j; i < count; ++i) x[i] = tail[i - j];
    total += tail;
  }
  const float inv = 1.0f / sum16(total);
  for (j = 0; j + kLanes <= count; j += kLanes) {
    const f32x16 prob = load16(x + j) * inv;
    store16(x + j, round ? round_to_bf16(prob) : prob);
  }
  for (; j < count; ++j) x[j] = round ? round_to_bf16(x[j] * inv) : x[j] * inv;
}

template <typename T>
struct PagedOperands {
  const float* q;
  T* pool;
  const int32_t *table, *kv_len;
  float* out;
};

// One (shard, slot, kv head) item, query heads [h0, h0 + NH).
template <int NH, typename T>
void attend_slot(const PagedShape& sh, const PagedOperands<T>& ops, int64_t item, int64_t h0, float* q, float* s,
                 float* o, const T** keys, const T** values) {
  constexpr bool kRound = sizeof(T) == 2;
  const int64_t k = item % sh.kvh, slot = item / sh.kvh, d = slot / sh.s;  // slot: d * S + s
  const int64_t len = std::min<int64_t>(ops.kv_len[slot], sh.width * sh.page);
  float* result = ops.out + (item * sh.hg + h0) * sh.dh;
  if (len <= 0) {
    std::fill(result, result + NH * sh.dh, 0.0f);
    return;
  }
  const float* qi = ops.q + (item * sh.hg + h0) * sh.dh;
  for (int64_t i = 0; i < NH * sh.dh; ++i) q[i] = kRound ? round_to_bf16(qi[i]) : qi[i];
  const int64_t token_stride = 2 * sh.kvh * sh.dh, page_stride = sh.page * token_stride;
  const T* shard = ops.pool + d * sh.pages * page_stride;
  const int32_t* table = ops.table + slot * sh.width;
  for (int64_t j = 0; j < len; ++j) {  // token j's key; its value follows it (head 2k + 1)
    const int64_t id = std::clamp<int64_t>(table[j / sh.page], 0, sh.pages - 1);
    keys[j] = shard + id * page_stride + (j % sh.page) * token_stride + 2 * k * sh.dh;
    values[j] = keys[j] + sh.dh;
  }
  scores<NH>(q, sh.dh, keys, len, s, len);
  const float scale = 1.0f / std::sqrt(float(sh.dh));
  for (int h = 0; h < NH; ++h) scaled_softmax(s + h * len, len, scale, kRound);
  std::fill(o, o + NH * sh.dh, 0.0f);
  weighted_values<NH>(s, len, values, sh.dh, len, o);
  std::copy(o, o + NH * sh.dh, result);
}

template <typename T>
void attend_items(const PagedShape& sh, const PagedOperands<T>& ops, int64_t begin, int64_t end) {
  std::vector<float> q(kMaxHeads * sh.dh), s(kMaxHeads * sh.width * sh.page), o(kMaxHeads * sh.dh);
  std::vector<const T*> keys(sh.width * sh.page), values(sh.width * sh.page);
  for (int64_t item = begin; item < end; ++item)
    for (int64_t h0 = 0; h0 < sh.hg; h0 += kMaxHeads) {
      switch (std::min<int64_t>(kMaxHeads, sh.hg - h0)) {
        case 1: attend_slot<1>(sh, ops, item, h0, q.data(), s.data(), o.data(), keys.data(), values.data()); break;
        case 2: attend_slot<2>(sh, ops, item, h0, q.data(), s.data(), o.data(), keys.data(), values.data()); break;
        case 3: attend_slot<3>(sh, ops, item, h0, q.data(), s.data(), o.data(), keys.data(), values.data()); break;
        default: attend_slot<kMaxHeads>(sh, ops, item, h0, q.data(), s.data(), o.data(), keys.data(), values.data()); break;
      }
    }
}

bool dims_are(const ffi::AnyBuffer::Dimensions& dims, std::initializer_list<int64_t> want) {
  if (dims.size() != want.size()) return false;
  for (size_t i = 0; i < want.size(); ++i)
    if (dims[i] != want.begin()[i]) return false;
  return true;
}

template <typename T>
void run(ffi::ThreadPool& pool, const PagedShape& sh, const float* q, const T* pool_in, const T* k_new,
         const T* v_new, const int32_t* write_page, const int32_t* write_offset, const int32_t* table,
         const int32_t* kv_len, float* out, T* pool_out) {
  const int64_t token = 2 * sh.kvh * sh.dh, page_elems = sh.page * token;
  if (pool_out != pool_in) std::memcpy(pool_out, pool_in, sizeof(T) * sh.d * sh.pages * page_elems);
  for (int64_t slot = 0; slot < sh.d * sh.s; ++slot) {  // the writes, before any read
    const int64_t page = write_page[slot], offset = write_offset[slot];
    if (page < 0 || page >= sh.pages || offset < 0 || offset >= sh.page) continue;  // out of range: dropped
    T* dst = pool_out + ((slot / sh.s) * sh.pages + page) * page_elems + offset * token;
    for (int64_t k = 0; k < sh.kvh; ++k) {
      std::memcpy(dst + 2 * k * sh.dh, k_new + (slot * sh.kvh + k) * sh.dh, sizeof(T) * sh.dh);
      std::memcpy(dst + (2 * k + 1) * sh.dh, v_new + (slot * sh.kvh + k) * sh.dh, sizeof(T) * sh.dh);
    }
  }
  const PagedOperands<T> ops{q, pool_out, table, kv_len, out};
  const int64_t items = sh.d * sh.s * sh.kvh;
  const int64_t grain = std::max<int64_t>(1, items / (4 * std::max<int64_t>(1, pool.num_threads() + 1)));
  parallel_for(pool, items, grain, [&](int64_t begin, int64_t end) { attend_items<T>(sh, ops, begin, end); });
}

ffi::Error paged_attention(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer pool,
                           ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> write_page,
                           ffi::Buffer<ffi::S32> write_offset, ffi::Buffer<ffi::S32> table,
                           ffi::Buffer<ffi::S32> kv_len, ffi::Result<ffi::Buffer<ffi::F32>> out,
                           ffi::Result<ffi::AnyBuffer> pool_out) {
  auto qd = q.dimensions(), pd = pool.dimensions(), td = table.dimensions();
  if (qd.size() != 5 || pd.size() != 5 || td.size() != 3)
    return ffi::Error::InvalidArgument("paged_attention: q and pool must be rank 5, table rank 3");
  const PagedShape sh{qd[0], qd[1], qd[2], qd[3], qd[4], pd[1], pd[2], td[2]};
  if (!dims_are(pd, {sh.d, sh.pages, sh.page, 2 * sh.kvh, sh.dh}))
    return ffi::Error::InvalidArgument("paged_attention: pool must be [D, pages, page, 2 KVH, Dh]");
  if (!dims_are(k_new.dimensions(), {sh.d, sh.s, sh.kvh, sh.dh}) ||
      !dims_are(v_new.dimensions(), {sh.d, sh.s, sh.kvh, sh.dh}))
    return ffi::Error::InvalidArgument("paged_attention: new keys and values must be [D, S, KVH, Dh]");
  if (!dims_are(write_page.dimensions(), {sh.d, sh.s}) || !dims_are(write_offset.dimensions(), {sh.d, sh.s}) ||
      !dims_are(kv_len.dimensions(), {sh.d, sh.s}) || !dims_are(td, {sh.d, sh.s, sh.width}))
    return ffi::Error::InvalidArgument("paged_attention: write_page, write_offset, kv_len [D, S], table [D, S, W]");
  if (!dims_are(pool_out->dimensions(), {sh.d, sh.pages, sh.page, 2 * sh.kvh, sh.dh}))
    return ffi::Error::InvalidArgument("paged_attention: the pool result must have the pool's shape");
  auto type = pool.element_type();
  const bool half = type == ffi::DataType::BF16 || type == ffi::DataType::U16;
  if (!half && type != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("paged_attention: pool dtype must be bfloat16 (or its uint16 bits) or float32");
  if (k_new.element_type() != type || v_new.element_type() != type || pool_out->element_type() != type)
    return ffi::Error::InvalidArgument("paged_attention: new keys, values and the pool must share one dtype");
  if (half)
    run<uint16_t>(thread_pool, sh, q.typed_data(), static_cast<const uint16_t*>(pool.untyped_data()),
                  static_cast<const uint16_t*>(k_new.untyped_data()), static_cast<const uint16_t*>(v_new.untyped_data()),
                  write_page.typed_data(), write_offset.typed_data(), table.typed_data(), kv_len.typed_data(),
                  out->typed_data(), static_cast<uint16_t*>(pool_out->untyped_data()));
  else
    run<float>(thread_pool, sh, q.typed_data(), static_cast<const float*>(pool.untyped_data()),
               static_cast<const float*>(k_new.untyped_data()), static_cast<const float*>(v_new.untyped_data()),
               write_page.typed_data(), write_offset.typed_data(), table.typed_data(), kv_len.typed_data(),
               out->typed_data(), static_cast<float*>(pool_out->untyped_data()));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxrl4llm

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxrl4llm_paged_attention, jaxrl4llm::paged_attention,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // q
                                  .Arg<xla::ffi::AnyBuffer>()              // pool
                                  .Arg<xla::ffi::AnyBuffer>()              // k_new
                                  .Arg<xla::ffi::AnyBuffer>()              // v_new
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // write_page
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // write_offset
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // table
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // kv_len
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // out
                                  .Ret<xla::ffi::AnyBuffer>());            // pool (aliased)
