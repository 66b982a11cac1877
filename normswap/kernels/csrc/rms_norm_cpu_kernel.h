// RMSNorm CPU row kernels, written once and compiled several times.
//
// This header is deliberately WITHOUT an include guard and WITHOUT includes: rms_norm_cpu.cpp
// includes it once per instruction-set variant, each time inside a different
// `#pragma GCC target(...)` region and with NORMSWAP_ISA_NS naming a different namespace.
// The code uses only GCC vector extensions and builtins, so the same source becomes SSE2 code
// in the baseline variant and AVX2+FMA code in the avx2 variant; the extension picks one at run
// time (__builtin_cpu_supports). That keeps the cached .so portable between x86-64 machines —
// no -march=native — while still running 256-bit code where the CPU has it. (at::vec cannot do
// this for an extension: its Vectorized<float> is chosen by the CPU_CAPABILITY macros at compile
// time, and an extension compiled without them silently gets the scalar fallback.)
//
// Everything is computed in fp32: loads convert bf16/fp16 to fp32 in registers, statistics
// and products are fp32, and the result is rounded to the storage type once, at the store.
// Summation order depends only on H (fixed lanes and accumulators), never on the row count or
// the thread count, so a row's rstd/y/dx are bit-reproducible.

#ifndef NORMSWAP_ISA_NS
#error "define NORMSWAP_ISA_NS before including rms_norm_cpu_kernel.h"
#endif

namespace NORMSWAP_ISA_NS {

// 8 fp32 lanes: one ymm register under AVX2, two xmm registers in the baseline variant.
constexpr int64_t kLanes = 8;
typedef float vf __attribute__((vector_size(32)));
typedef uint32_t vu32 __attribute__((vector_size(32)));
typedef int32_t vi32 __attribute__((vector_size(32)));
typedef uint16_t vu16 __attribute__((vector_size(16)));

static inline vf vsplat(float s) {
  vf v = {s, s, s, s, s, s, s, s};
  return v;
}

static inline float vhsum(vf v) {
  // Fixed pairwise order: the result depends on the lane values only.
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// ---- storage types: load 8 elements as fp32, store 8 fp32 values rounded to the type ----

struct F32 {
  typedef float T;
  static inline vf load(const T* p) {
    vf v;
    __builtin_memcpy(&v, p, sizeof(v));
    return v;
  }
  static inline void store(T* p, vf v) { __builtin_memcpy(p, &v, sizeof(v)); }
  static inline vf round(vf v) { return v; }
  static inline float load1(const T* p) { return *p; }
  static inline void store1(T* p, float v) { *p = v; }
  static inline float round1(float v) { return v; }
};

// bfloat16 is carried as its 16 raw bits. fp32 -> bf16 rounds to nearest even and keeps NaN a
// (quiet) NaN, which is exactly c10::BFloat16's conversion, so results match torch's casts.
struct BF16 {
  typedef uint16_t T;
  static inline vf load(const T* p) {
    vu16 h;
    __builtin_memcpy(&h, p, sizeof(h));
    vu32 w = __builtin_convertvector(h, vu32) << 16;
    return (vf)w;
  }
  static inline vu32 to_bits(vf v) {
    vu32 b = (vu32)v;
    vu32 r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    vu32 nan = (vu32)(v != v);
    return (r & ~nan) | (0x7FC0u & nan);
  }
  static inline void store(T* p, vf v) {
    vu16 h = __builtin_convertvector(to_bits(v), vu16);
    __builtin_memcpy(p, &h, sizeof(h));
  }
  static inline vf round(vf v) { return (vf)(to_bits(v) << 16); }
  static inline float load1(const T* p) {
    uint32_t w = (uint32_t)(*p) << 16;
    float f;
    __builtin_memcpy(&f, &w, 4);
    return f;
  }
  static inline uint16_t bits1(float f) {
    if (f != f) return 0x7FC0u;
    uint32_t b;
    __builtin_memcpy(&b, &f, 4);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  }
  static inline void store1(T* p, float v) { *p = bits1(v); }
  static inline float round1(float v) {
    uint32_t w = (uint32_t)bits1(v) << 16;
    float f;
    __builtin_memcpy(&f, &w, 4);
    return f;
  }
};

#ifdef NORMSWAP_HAVE_FLOAT16
// float16 through the compiler's _Float16: F16C conversions in the avx2 variant, libgcc's
// software conversion (correct, slower) in the baseline one. Rounding is to nearest even.
typedef _Float16 vh __attribute__((vector_size(16)));
struct F16 {
  typedef _Float16 T;
  static inline vf load(const T* p) {
    vh h;
    __builtin_memcpy(&h, p, sizeof(h));
    return __builtin_convertvector(h, vf);
  }
  static inline void store(T* p, vf v) {
    vh h = __builtin_convertvector(v, vh);
    __builtin_memcpy(p, &h, sizeof(h));
  }
  static inline vf round(vf v) { return __builtin_convertvector(__builtin_convertvector(v, vh), vf); }
  static inline float load1(const T* p) { return (float)*p; }
  static inline void store1(T* p, float v) { *p = (_Float16)v; }
  static inline float round1(float v) { return (float)(_Float16)v; }
};
#endif

// ---- forward ----
//
// Per row: pass 1 reads x (or forms s = x + residual, rounds it to the storage type, stores it
// as `summed` and uses the ROUNDED value, the same tensor the backward will receive), sums the
// squares in fp32; pass 2 re-reads the row (now in L1/L2) and writes
//   y = cast_T( (x * rstd) * w )          (w is fp32; no weight: cast_T(x * rstd))
// i.e. normalise in fp32, multiply by the weight in fp32, cast once. With a bias b (arriving as
// fp32 holding values already rounded to T): y = cast_T( cast_T((x * rstd) * w) + b ), bit for
// bit what a separate `y + b.to(T)` computes, without a second pass over y or a second op call.

template <class L, bool HAS_W, bool RES, bool HAS_B>
static void fwd_rows(const FwdArgs& a, int64_t r0, int64_t r1) {
  typedef typename L::T T;
  const int64_t H = a.H;
  const int64_t H32 = H - H % (4 * kLanes);
  const int64_t H8 = H - H % kLanes;
  const float* w = static_cast<const float*>(a.w);  // always fp32 (see the binding)
  const float* b = a.b;                              // fp32, rounded to T by the binding
  const float inv_h = 1.0f / (float)H;
  for (int64_t i = r0; i < r1; ++i) {
    const T* x = static_cast<const T*>(a.x) + i * H;
    T* y = static_cast<T*>(a.y) + i * H;
    vf acc0 = vsplat(0.f), acc1 = vsplat(0.f), acc2 = vsplat(0.f), acc3 = vsplat(0.f);
    float tail = 0.f;
    const T* src = x;
    if (RES) {
      const T* r = static_cast<const T*>(a.res) + i * H;
      T* s = static_cast<T*>(a.summed) + i * H;
      int64_t j = 0;
      for (; j < H32; j += 4 * kLanes) {
        vf v0 = L::round(L::load(x + j) + L::load(r + j));
        vf v1 = L::round(L::load(x + j + kLanes) + L::load(r + j + kLanes));
        vf v2 = L::round(L::load(x + j + 2 * kLanes) + L::load(r + j + 2 * kLanes));
        vf v3 = L::round(L::load(x + j + 3 * kLanes) + L::load(r + j + 3 * kLanes));
        L::store(s + j, v0);
        L::store(s + j + kLanes, v1);
        L::store(s + j + 2 * kLanes, v2);
        L::store(s + j + 3 * kLanes, v3);
        acc0 += v0 * v0;
        acc1 += v1 * v1;
        acc2 += v2 * v2;
        acc3 += v3 * v3;
      }
      for (; j < H8; j += kLanes) {
        vf v0 = L::round(L::load(x + j) + L::load(r + j));
        L::store(s + j, v0);
        acc0 += v0 * v0;
      }
      for (; j < H; ++j) {
        float v = L::round1(L::load1(x + j) + L::load1(r + j));
        L::store1(s + j, v);
        tail += v * v;
      }
      src = s;
    } else {
      int64_t j = 0;
      for (; j < H32; j += 4 * kLanes) {
        vf v0 = L::load(x + j);
        vf v1 = L::load(x + j + kLanes);
        vf v2 = L::load(x + j + 2 * kLanes);
        vf v3 = L::load(x + j + 3 * kLanes);
        acc0 += v0 * v0;
        acc1 += v1 * v1;
        acc2 += v2 * v2;
        acc3 += v3 * v3;
      }
      for (; j < H8; j += kLanes) {
        vf v0 = L::load(x + j);
        acc0 += v0 * v0;
      }
      for (; j < H; ++j) {
        float v = L::load1(x + j);
        tail += v * v;
      }
    }
    const float ss = vhsum((acc0 + acc1) + (acc2 + acc3)) + tail;
    const float rs = 1.0f / __builtin_sqrtf(ss * inv_h + a.eps);
    a.rstd[i] = rs;
    const vf vr = vsplat(rs);
    int64_t j = 0;
    for (; j < H32; j += 4 * kLanes) {
      vf v0 = L::load(src + j) * vr;
      vf v1 = L::load(src + j + kLanes) * vr;
      vf v2 = L::load(src + j + 2 * kLanes) * vr;
      vf v3 = L::load(src + j + 3 * kLanes) * vr;
      if (HAS_W) {
        v0 *= F32::load(w + j);
        v1 *= F32::load(w + j + kLanes);
        v2 *= F32::load(w + j + 2 * kLanes);
        v3 *= F32::load(w + j + 3 * kLanes);
      }
      if (HAS_B) {
        v0 = L::round(v0) + F32::load(b + j);
        v1 = L::round(v1) + F32::load(b + j + kLanes);
        v2 = L::round(v2) + F32::load(b + j + 2 * kLanes);
        v3 = L::round(v3) + F32::load(b + j + 3 * kLanes);
      }
      L::store(y + j, v0);
      L::store(y + j + kLanes, v1);
      L::store(y + j + 2 * kLanes, v2);
      L::store(y + j + 3 * kLanes, v3);
    }
    for (; j < H8; j += kLanes) {
      vf v0 = L::load(src + j) * vr;
      if (HAS_W) v0 *= F32::load(w + j);
      if (HAS_B) v0 = L::round(v0) + F32::load(b + j);
      L::store(y + j, v0);
    }
    for (; j < H; ++j) {
      float v = L::load1(src + j) * rs;
      if (HAS_W) v *= F32::load1(w + j);
      if (HAS_B) v = L::round1(v) + b[j];
      L::store1(y + j, v);
    }
  }
}

// ---- backward ----
//
// With g = dy * w and xhat = x * rstd (x: the tensor that was normalised),
//   dx = rstd * (g - xhat * mean(g * xhat)) = rstd * g - x * (rstd^3 * sum(g * x) / H)
//   dw = sum over rows of dy * xhat           (fp32, into this thread's partial row)
// Pass 1 reads dy and x once for sum(g * x) and the dw partial; pass 2 re-reads them (the row
// is cache-resident) and writes dx.

template <class L, bool HAS_W, bool DW>
static void bwd_rows(const BwdArgs& a, float* dwp, int64_t r0, int64_t r1) {
  typedef typename L::T T;
  const int64_t H = a.H;
  const int64_t H32 = H - H % (4 * kLanes);
  const int64_t H8 = H - H % kLanes;
  const float* w = static_cast<const float*>(a.w);  // always fp32 (see the binding)
  const float inv_h = 1.0f / (float)H;
  for (int64_t i = r0; i < r1; ++i) {
    const T* dy = static_cast<const T*>(a.dy) + i * H;
    const T* x = static_cast<const T*>(a.x) + i * H;
    T* dx = static_cast<T*>(a.dx) + i * H;
    const float rs = a.rstd[i];
    const vf vr = vsplat(rs);
    vf acc0 = vsplat(0.f), acc1 = vsplat(0.f), acc2 = vsplat(0.f), acc3 = vsplat(0.f);
    float tail = 0.f;
    int64_t j = 0;
    for (; j < H32; j += 4 * kLanes) {
      vf d0 = L::load(dy + j), d1 = L::load(dy + j + kLanes);
      vf d2 = L::load(dy + j + 2 * kLanes), d3 = L::load(dy + j + 3 * kLanes);
      vf x0 = L::load(x + j), x1 = L::load(x + j + kLanes);
      vf x2 = L::load(x + j + 2 * kLanes), x3 = L::load(x + j + 3 * kLanes);
      if (DW) {
        F32::store(dwp + j, F32::load(dwp + j) + d0 * (x0 * vr));
        F32::store(dwp + j + kLanes, F32::load(dwp + j + kLanes) + d1 * (x1 * vr));
        F32::store(dwp + j + 2 * kLanes, F32::load(dwp + j + 2 * kLanes) + d2 * (x2 * vr));
        F32::store(dwp + j + 3 * kLanes, F32::load(dwp + j + 3 * kLanes) + d3 * (x3 * vr));
      }
      if (HAS_W) {
        d0 *= F32::load(w + j);
        d1 *= F32::load(w + j + kLanes);
        d2 *= F32::load(w + j + 2 * kLanes);
        d3 *= F32::load(w + j + 3 * kLanes);
      }
      acc0 += d0 * x0;
      acc1 += d1 * x1;
      acc2 += d2 * x2;
      acc3 += d3 * x3;
    }
    for (; j < H8; j += kLanes) {
      vf d0 = L::load(dy + j), x0 = L::load(x + j);
      if (DW) F32::store(dwp + j, F32::load(dwp + j) + d0 * (x0 * vr));
      if (HAS_W) d0 *= F32::load(w + j);
      acc0 += d0 * x0;
    }
    for (; j < H; ++j) {
      float d = L::load1(dy + j), xv = L::load1(x + j);
      if (DW) dwp[j] += d * (xv * rs);
      if (HAS_W) d *= F32::load1(w + j);
      tail += d * xv;
    }
    const float s = vhsum((acc0 + acc1) + (acc2 + acc3)) + tail;
    const float c = rs * rs * rs * (s * inv_h);
    const vf vc = vsplat(c);
    j = 0;
    for (; j < H32; j += 4 * kLanes) {
      vf d0 = L::load(dy + j), d1 = L::load(dy + j + kLanes);
      vf d2 = L::load(dy + j + 2 * kLanes), d3 = L::load(dy + j + 3 * kLanes);
      if (HAS_W) {
        d0 *= F32::load(w + j);
        d1 *= F32::load(w + j + kLanes);
        d2 *= F32::load(w + j + 2 * kLanes);
        d3 *= F32::load(w + j + 3 * kLanes);
      }
      L::store(dx + j, vr * d0 - L::load(x + j) * vc);
      L::store(dx + j + kLanes, vr * d1 - L::load(x + j + kLanes) * vc);
      L::store(dx + j + 2 * kLanes, vr * d2 - L::load(x + j + 2 * kLanes) * vc);
      L::store(dx + j + 3 * kLanes, vr * d3 - L::load(x + j + 3 * kLanes) * vc);
    }
    for (; j < H8; j += kLanes) {
      vf d0 = L::load(dy + j);
      if (HAS_W) d0 *= F32::load(w + j);
      L::store(dx + j, vr * d0 - L::load(x + j) * vc);
    }
    for (; j < H; ++j) {
      float d = L::load1(dy + j);
      if (HAS_W) d *= F32::load1(w + j);
      L::store1(dx + j, rs * d - L::load1(x + j) * c);
    }
  }
}

// ---- tables, indexed [dtype][has weight][flag] (forward: [flag][has bias]) ----
// dtype: 0 float32, 1 bfloat16, 2 float16. The weight always arrives as fp32 (the binding
// converts it once per call: converting a bf16 weight inside the row loop cost ~20% measured).
// flag: residual (forward) / compute dweight (backward).

template <class L>
static void fill_for_dtype(Table& t, int d) {
  t.fwd[d][0][0][0] = &fwd_rows<L, false, false, false>;
  t.fwd[d][0][1][0] = &fwd_rows<L, false, true, false>;
  t.fwd[d][1][0][0] = &fwd_rows<L, true, false, false>;
  t.fwd[d][1][1][0] = &fwd_rows<L, true, true, false>;
  t.fwd[d][0][0][1] = &fwd_rows<L, false, false, true>;
  t.fwd[d][0][1][1] = &fwd_rows<L, false, true, true>;
  t.fwd[d][1][0][1] = &fwd_rows<L, true, false, true>;
  t.fwd[d][1][1][1] = &fwd_rows<L, true, true, true>;
  t.bwd[d][0][0] = &bwd_rows<L, false, false>;
  t.bwd[d][0][1] = nullptr;  // no weight, no dweight
  t.bwd[d][1][0] = &bwd_rows<L, true, false>;
  t.bwd[d][1][1] = &bwd_rows<L, true, true>;
}

static Table make_table() {
  Table t = {};
  fill_for_dtype<F32>(t, 0);
  fill_for_dtype<BF16>(t, 1);
#ifdef NORMSWAP_HAVE_FLOAT16
  fill_for_dtype<F16>(t, 2);
#endif
  return t;
}

}  // namespace NORMSWAP_ISA_NS
