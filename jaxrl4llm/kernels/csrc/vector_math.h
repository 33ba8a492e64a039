// 16-lane float vectors (GCC/Clang vector extensions: AVX-512 registers where the CPU has them,
// pairs of AVX2 registers otherwise), bfloat16 loads, and an exp the compiler keeps in vectors.
#pragma once

#include <cstdint>
#include <cstring>

namespace jaxrl4llm {

constexpr int kLanes = 16;
typedef float f32x16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i32x16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t u32x16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// Scalar loads as float32 (bfloat16 is the high half of a float32).
inline float load(const uint16_t* p, int64_t i) { return bits_to_float(uint32_t(p[i]) << 16); }
inline float load(const float* p, int64_t i) { return p[i]; }

// 16 consecutive elements as float32.
inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x16 load16(const uint16_t* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }
inline f32x16 splat(float x) { return f32x16{} + x; }

inline float sum16(f32x16 v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// float32 -> bfloat16 -> float32, round to nearest even (XLA's convert; finite inputs).
inline float round_to_bf16(float x) {
  uint32_t bits = float_to_bits(x);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return bits_to_float(bits & 0xFFFF0000u);
}
inline f32x16 round_to_bf16(f32x16 x) {
  u32x16 bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  bits &= 0xFFFF0000u;
  f32x16 out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// exp(x) for x <= 0 (softmax after subtracting the max): exp(x) = 2^n exp(r), r = x - n ln2, with
// a degree-6 polynomial for exp(r) (relative error ~2e-7); exactly 0 below -87.3, where float32
// exp underflows.
inline f32x16 exp_nonpositive(f32x16 x) {
  const i32x16 tiny = x < -87.3f;
  x = tiny ? splat(-87.3f) : x;
  const f32x16 shifter = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const f32x16 n = (x * 1.44269504088896341f + shifter) - shifter;
  f32x16 r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  f32x16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i32x16 e = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &e, sizeof scale);
  return tiny ? splat(0.0f) : p * scale;
}

}  // namespace jaxrl4llm
