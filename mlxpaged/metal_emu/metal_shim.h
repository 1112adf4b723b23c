// metal_shim.h: enough of the Metal Shading Language, as C++ for clang, to run MLX custom
// kernels (and MLX's own utils preamble) on the CPU under mlxpaged.metal_emu.
//
// Reached through `#include <metal_stdlib>`: the emulator's include directory holds a file of
// that name that includes this one. Invariants:
//  * Address spaces are real clang address spaces (device=1, constant=2, threadgroup=3,
//    thread=generic), so mixing them is a compile error as in Metal.
//  * half is _Float16 and bfloat is __bf16, compiled with excess precision off: every
//    operation rounds to the type, as Metal's ALUs do. No double.
//  * SIMD-group functions and barriers call into runtime.cpp, which runs each GPU thread as a
//    fiber and resolves a collective only once every live lane of the SIMD group reached it.
//  * Loads and stores are counted by the compiler's load/store tracing (runtime.cpp), not here.
#pragma once

#include <stdint.h>
#include <stddef.h>
#include <type_traits>
#include <limits>

#define MLXEMU_AS_DEVICE __attribute__((address_space(1)))
#define MLXEMU_AS_CONSTANT __attribute__((address_space(2)))
#define MLXEMU_AS_THREADGROUP __attribute__((address_space(3)))
#define device MLXEMU_AS_DEVICE
#define constant MLXEMU_AS_CONSTANT
#define threadgroup MLXEMU_AS_THREADGROUP
#define thread
#define kernel
// Address-space-qualified methods (`f() const constant {...}`) are rewritten by lower.py to
// MLXEMU_AS_METHOD_<space>: a never-viable overload (distinct per space), so the `thread` one is always picked.
#define MLXEMU_AS_METHOD_constant __attribute__((enable_if(1 == 2, "constant-qualified overload")))
#define MLXEMU_AS_METHOD_device __attribute__((enable_if(2 == 3, "device-qualified overload")))
#define MLXEMU_AS_METHOD_threadgroup __attribute__((enable_if(3 == 4, "threadgroup-qualified overload")))
// Statement-level `threadgroup` declarations lower.py cannot turn into arena slots (several
// declarators, initializers) get this prefix: one static per kernel, which is one storage per
// threadgroup because threadgroups run one at a time (NaN-filled, but no bounds/race checks).
#define MLXEMU_TG_STATIC static __attribute__((section("mlxemu_tg"), aligned(16)))

#define METAL_FUNC inline __attribute__((always_inline))
#define __METAL_MAYBE_FAST_MATH__ 0
#define __METAL_FAST_MATH__ 1
#define __METAL_PRECISE_MATH__ 2
#define __METAL_VERSION__ 310
#define MLX_METAL_JIT 1

// half and bfloat are type keywords in MSL, like float: macros, not typedefs, so that a variable
// named after one (`int half = n / 2;`) fails here as it fails in Apple's compiler.
#define half _Float16
#define bfloat __bf16
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;

// ---------------------------------------------------------------------------------------------
// Runtime entry points (runtime.cpp). Sites are return addresses inside the kernel code.
extern "C" {
void mlxemu_barrier(int simd_only, int flags, const char* file, int line, int col);
void mlxemu_count_op(int kind);  // cost model: 0 exp, 1 exp2
// Register model: a thread-private array (or struct holding arrays) declared at `site`.
void mlxemu_regs(int site, unsigned long bytes);
// Publishes `size` bytes of this lane's value, waits for the SIMD group, returns the 32 lanes'
// values (inactive lanes filled with 0xFF bytes) and the mask of active lanes.
const void* mlxemu_simd_sync(int kind, const void* value, int size, uint* active_mask, uint* lane,
                             const char* file, int line, int col);
void mlxemu_atomic(int enter);  // brackets atomic operations: exempt from the race check
// Storage of one `threadgroup` declaration (lower.py rewrites declarations to call it).
void* mlxemu_tg_slot(int id, size_t size, size_t align, const char* name);
}
// lower.py names a threadgroup array's type through this alias (a vector type's name followed by
// `(` would be the shim's constructor macro).
template <class T> using mlxemu_type = T;
// Casts to an address-space pointer type (lower.py turns `(device T*)x` into
// `mlxemu_ascast<device T*>{} % x`, and `*(device T*)x` into `*mlxemu_ascast<...>{} % x`): the
// source and target pointee address spaces must agree, as Metal requires (clang's C-style cast
// would convert silently). `%` binds like a cast here: tighter than every binary operator below it.
template <class T> constexpr int mlxemu_as_of(T*) { return 0; }
template <class T> constexpr int mlxemu_as_of(MLXEMU_AS_DEVICE T*) { return 1; }
template <class T> constexpr int mlxemu_as_of(MLXEMU_AS_CONSTANT T*) { return 2; }
template <class T> constexpr int mlxemu_as_of(MLXEMU_AS_THREADGROUP T*) { return 3; }
template <class X> constexpr int mlxemu_as_of(X) { return -1; }  // not a pointer (an integer)
// Inner: a cast applied first (`(A*)(B*)x` lowers to `ascast<A>{} % ascast<B>{} % x`, which
// groups left to right); Deref: a leading `*`.
template <class To, class Inner = void, bool Deref = false> struct mlxemu_ascast {};
template <class To, class I> constexpr mlxemu_ascast<To, I, true> operator*(mlxemu_ascast<To, I, false>) { return {}; }
template <class To, bool D, class B, class J>
constexpr mlxemu_ascast<To, mlxemu_ascast<B, J, false>, D> operator%(mlxemu_ascast<To, void, D>, mlxemu_ascast<B, J, false>) { return {}; }
template <class To, class Inner, bool D, class From>
inline decltype(auto) operator%(mlxemu_ascast<To, Inner, D>, From x) {
  if constexpr (!std::is_void_v<Inner>) {
    return mlxemu_ascast<To, void, D>{} % (Inner{} % x);
  } else {
    static_assert(mlxemu_as_of((From)0) < 0 || mlxemu_as_of((From)0) == mlxemu_as_of((To)0),
                  "cast between address spaces (not allowed in Metal)");
    if constexpr (D) return *(To)x; else return (To)x;
  }
}

// Every barrier and SIMD-group function takes its call site (file, line, column of the caller,
// through defaulted trailing parameters): threads "at the same barrier" means at the same source
// location, which survives the optimizer duplicating code (unlike return addresses).
#define MLXEMU_SITE const char* mlxemu_file = __builtin_FILE(), int mlxemu_line = __builtin_LINE(), int mlxemu_col = __builtin_COLUMN()
#define MLXEMU_SITE_ARGS mlxemu_file, mlxemu_line, mlxemu_col

namespace metal {

// ---------------------------------------------------------------------------------------------
// Vector types
template <typename T, int N>
using vec = T __attribute__((ext_vector_type(N)));

#define MLXEMU_VEC(T)                 \
  typedef vec<T, 2> T##2;             \
  typedef vec<T, 3> T##3;             \
  typedef vec<T, 4> T##4;
MLXEMU_VEC(bool)
MLXEMU_VEC(char)
MLXEMU_VEC(uchar)
MLXEMU_VEC(short)
MLXEMU_VEC(ushort)
MLXEMU_VEC(int)
MLXEMU_VEC(uint)
MLXEMU_VEC(long)
MLXEMU_VEC(ulong)
MLXEMU_VEC(half)
MLXEMU_VEC(bfloat)
MLXEMU_VEC(float)
#undef MLXEMU_VEC

template <typename T>
struct vinfo {
  using elem = T;
  static constexpr int n = 1;
  static constexpr bool is_vec = false;
};
template <typename T, int N>
struct vinfo<T __attribute__((ext_vector_type(N)))> {
  using elem = T;
  static constexpr int n = N;
  static constexpr bool is_vec = true;
};

// Metal's `float4(a, b)`-style constructors (see the function-like macros below): splat a
// scalar, convert a vector elementwise, or concatenate scalars and vectors.
template <typename V, typename A>
inline void mlxemu_fill(V& out, int& k, const A& a) {
  if constexpr (vinfo<A>::is_vec) {
    for (int i = 0; i < vinfo<A>::n; ++i) out[k++] = static_cast<typename vinfo<V>::elem>(a[i]);
  } else {
    out[k++] = static_cast<typename vinfo<V>::elem>(a);
  }
}
template <typename E, int N, typename... A>
inline vec<E, N> mlxemu_make(const A&... a) {
  vec<E, N> out;
  if constexpr (sizeof...(A) == 1 && !(vinfo<A>::is_vec && ...)) {
    (void)((out = vec<E, N>(static_cast<E>(a))), ...);
  } else {
    int k = 0;
    (mlxemu_fill(out, k, a), ...);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Type traits (the subset MLX and typical kernels use), with half and bfloat as floats.
using std::conditional;
using std::conditional_t;
using std::enable_if;
using std::enable_if_t;
using std::integral_constant;
using std::is_convertible;
using std::is_convertible_v;
using std::is_integral;
using std::is_integral_v;
using std::is_same;
using std::is_same_v;
using std::is_signed;
using std::is_signed_v;
using std::is_unsigned;
using std::is_unsigned_v;
using std::make_signed;
using std::make_signed_t;
using std::make_unsigned;
using std::make_unsigned_t;
using std::remove_cv;
using std::remove_cv_t;
using std::remove_reference;
using std::remove_reference_t;
using std::remove_pointer;
using std::remove_pointer_t;
using std::decay;
using std::decay_t;
using std::true_type;
using std::false_type;
using std::bool_constant;
using std::is_arithmetic;
using std::is_arithmetic_v;

template <typename T>
struct is_floating_point
    : bool_constant<std::is_same_v<std::remove_cv_t<T>, float> ||
                    std::is_same_v<std::remove_cv_t<T>, half> ||
                    std::is_same_v<std::remove_cv_t<T>, bfloat>> {};
template <typename T>
constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <typename T>
struct is_scalar : bool_constant<!vinfo<T>::is_vec> {};
template <typename T>
constexpr bool is_scalar_v = is_scalar<T>::value;
template <typename T>
struct is_vector : bool_constant<vinfo<T>::is_vec> {};
template <typename T>
constexpr bool is_vector_v = is_vector<T>::value;

// numeric_limits: std's for integers and float; half and bfloat written out.
template <typename T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr half max() { return __builtin_bit_cast(half, (ushort)0x7BFF); }
  static constexpr half min() { return __builtin_bit_cast(half, (ushort)0x0400); }
  static constexpr half lowest() { return __builtin_bit_cast(half, (ushort)0xFBFF); }
  static constexpr half epsilon() { return __builtin_bit_cast(half, (ushort)0x1400); }
  static constexpr half infinity() { return __builtin_bit_cast(half, (ushort)0x7C00); }
  static constexpr half quiet_NaN() { return __builtin_bit_cast(half, (ushort)0x7E00); }
  static constexpr half denorm_min() { return __builtin_bit_cast(half, (ushort)0x0001); }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static constexpr bfloat max() { return __builtin_bit_cast(bfloat, (ushort)0x7F7F); }
  static constexpr bfloat min() { return __builtin_bit_cast(bfloat, (ushort)0x0080); }
  static constexpr bfloat lowest() { return __builtin_bit_cast(bfloat, (ushort)0xFF7F); }
  static constexpr bfloat epsilon() { return __builtin_bit_cast(bfloat, (ushort)0x3C00); }
  static constexpr bfloat infinity() { return __builtin_bit_cast(bfloat, (ushort)0x7F80); }
  static constexpr bfloat quiet_NaN() { return __builtin_bit_cast(bfloat, (ushort)0x7FC0); }
  static constexpr bfloat denorm_min() { return __builtin_bit_cast(bfloat, (ushort)0x0001); }
};

template <typename To, typename From>
inline To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  return __builtin_bit_cast(To, x);
}

// ---------------------------------------------------------------------------------------------
// Math. Scalars compute in float and round to the argument's type (Metal's half and bfloat
// functions are at least that accurate); vectors apply the scalar function per element.
template <typename T>
constexpr bool mlxemu_is_fscalar = is_floating_point_v<T>;
template <typename T>
constexpr bool mlxemu_is_fvec = vinfo<T>::is_vec && is_floating_point_v<typename vinfo<T>::elem>;

#define MLXEMU_MATH1(NAME, EXPR)                                                     \
  template <typename T, enable_if_t<mlxemu_is_fscalar<T>, int> = 0>                \
  inline T NAME(T x_) {                                                            \
    float x = (float)x_;                                                           \
    return (T)(EXPR);                                                              \
  }                                                                                \
  template <typename T, enable_if_t<mlxemu_is_fvec<T>, int> = 0>                   \
  inline T NAME(T x_) {                                                            \
    T r;                                                                           \
    for (int i = 0; i < vinfo<T>::n; ++i) r[i] = NAME(x_[i]);                      \
    return r;                                                                      \
  }
#define MLXEMU_MATH2(NAME, EXPR)                                                     \
  template <typename T, enable_if_t<mlxemu_is_fscalar<T>, int> = 0>                \
  inline T NAME(T x_, T y_) {                                                      \
    float x = (float)x_, y = (float)y_;                                            \
    return (T)(EXPR);                                                              \
  }                                                                                \
  template <typename T, enable_if_t<mlxemu_is_fvec<T>, int> = 0>                   \
  inline T NAME(T x_, T y_) {                                                      \
    T r;                                                                           \
    for (int i = 0; i < vinfo<T>::n; ++i) r[i] = NAME(x_[i], y_[i]);               \
    return r;                                                                      \
  }

#define MLXEMU_MATH_ALL(M1, M2)                          \
  M1(acos, __builtin_acosf(x)) M1(acosh, __builtin_acoshf(x)) M1(asin, __builtin_asinf(x)) M1(asinh, __builtin_asinhf(x))   \
  M1(atan, __builtin_atanf(x)) M1(atanh, __builtin_atanhf(x)) M1(ceil, __builtin_ceilf(x)) M1(cos, __builtin_cosf(x))       \
  M1(cosh, __builtin_coshf(x)) M1(cospi, __builtin_cosf(x * 3.14159265358979323846f))                   \
  M1(exp, (mlxemu_count_op(0), __builtin_expf(x))) M1(exp10, __builtin_powf(10.0f, x)) M1(exp2, (mlxemu_count_op(1), __builtin_exp2f(x))) M1(fabs, __builtin_fabsf(x))       \
  M1(floor, __builtin_floorf(x)) M1(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))              \
  M1(log, __builtin_logf(x)) M1(log10, __builtin_log10f(x)) M1(log2, __builtin_log2f(x)) M1(rint, __builtin_rintf(x))       \
  M1(round, __builtin_roundf(x)) M1(rsqrt, 1.0f / __builtin_sqrtf(x)) M1(sin, __builtin_sinf(x)) M1(sinh, __builtin_sinhf(x)) \
  M1(sinpi, __builtin_sinf(x * 3.14159265358979323846f)) M1(sqrt, __builtin_sqrtf(x)) M1(tan, __builtin_tanf(x))  \
  M1(tanh, __builtin_tanhf(x)) M1(tanpi, __builtin_tanf(x * 3.14159265358979323846f)) M1(trunc, __builtin_truncf(x)) \
  M1(log1p, __builtin_log1pf(x)) M1(expm1, __builtin_expm1f(x)) M1(erf, __builtin_erff(x)) M1(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f)) \
  M2(atan2, __builtin_atan2f(x, y)) M2(divide, x / y) M2(fdim, __builtin_fdimf(x, y)) M2(fmax, __builtin_fmaxf(x, y)) \
  M2(fmin, __builtin_fminf(x, y)) M2(fmod, __builtin_fmodf(x, y)) M2(nextafter, __builtin_nextafterf(x, y))      \
  M2(pow, __builtin_powf(x, y)) M2(powr, __builtin_powf(x, y)) M2(copysign, __builtin_copysignf(x, y))

MLXEMU_MATH_ALL(MLXEMU_MATH1, MLXEMU_MATH2)

// Metal's compiler builtins, as MLX's bf16_math.h calls them (float in, float out; the
// trailing int is the fast-math mode, ignored: the emulator computes precise results).
} // namespace metal
#define MLXEMU_B1(NAME, EXPR) inline float __metal_##NAME(float x, int = 0) { return (EXPR); }
#define MLXEMU_B2(NAME, EXPR) inline float __metal_##NAME(float x, float y, int = 0) { return (EXPR); }
MLXEMU_MATH_ALL(MLXEMU_B1, MLXEMU_B2)
#undef MLXEMU_B1
#undef MLXEMU_B2
inline float __metal_fma(float x, float y, float z) { return __builtin_fmaf(x, y, z); }
inline float __metal_fmax3(float x, float y, float z, int = 0) { return __builtin_fmaxf(__builtin_fmaxf(x, y), z); }
inline float __metal_fmin3(float x, float y, float z, int = 0) { return __builtin_fminf(__builtin_fminf(x, y), z); }
inline float __metal_fmedian3(float x, float y, float z, int = 0) { return __builtin_fmaxf(__builtin_fminf(x, y), __builtin_fminf(__builtin_fmaxf(x, y), z)); }
inline float __metal_frexp(float x, int* e) { return __builtin_frexpf(x, e); }
inline float __metal_ldexp(float x, int k, int = 0) { return __builtin_ldexpf(x, k); }
namespace metal {

template <typename T, enable_if_t<mlxemu_is_fscalar<T>, int> = 0>
inline T fma(T a, T b, T c) { return (T)__builtin_fmaf((float)a, (float)b, (float)c); }
template <typename T, enable_if_t<mlxemu_is_fvec<T>, int> = 0>
inline T fma(T a, T b, T c) {
  T r;
  for (int i = 0; i < vinfo<T>::n; ++i) r[i] = fma(a[i], b[i], c[i]);
  return r;
}
template <typename T, enable_if_t<mlxemu_is_fscalar<T>, int> = 0>
inline T ldexp(T x, int e) { return (T)__builtin_ldexpf((float)x, e); }

// abs/min/max/clamp for every scalar and vector type. Floats follow fmin/fmax (NaN-ignoring).
template <typename T, enable_if_t<!vinfo<T>::is_vec, int> = 0>
inline T abs(T x) { return x < T(0) ? T(-x) : x; }
template <typename T, enable_if_t<vinfo<T>::is_vec, int> = 0>
inline T abs(T x) { T r; for (int i = 0; i < vinfo<T>::n; ++i) r[i] = abs(x[i]); return r; }
template <typename T, enable_if_t<!vinfo<T>::is_vec, int> = 0>
inline T max(T a, T b) {
  if constexpr (is_floating_point_v<T>) return (T)__builtin_fmaxf((float)a, (float)b);
  else return a > b ? a : b;
}
template <typename T, enable_if_t<!vinfo<T>::is_vec, int> = 0>
inline T min(T a, T b) {
  if constexpr (is_floating_point_v<T>) return (T)__builtin_fminf((float)a, (float)b);
  else return a < b ? a : b;
}
template <typename T, enable_if_t<vinfo<T>::is_vec, int> = 0>
inline T max(T a, T b) { T r; for (int i = 0; i < vinfo<T>::n; ++i) r[i] = max(a[i], b[i]); return r; }
template <typename T, enable_if_t<vinfo<T>::is_vec, int> = 0>
inline T min(T a, T b) { T r; for (int i = 0; i < vinfo<T>::n; ++i) r[i] = min(a[i], b[i]); return r; }
template <typename T>
inline T max3(T a, T b, T c) { return max(max(a, b), c); }
template <typename T>
inline T min3(T a, T b, T c) { return min(min(a, b), c); }
template <typename T>
inline T median3(T a, T b, T c) { return max(min(a, b), min(max(a, b), c)); }
template <typename T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <typename T, typename U>
inline T mix(T x, T y, U a) { return x + (y - x) * a; }
template <typename T, typename C>
inline T select(T a, T b, C c) {
  if constexpr (vinfo<T>::is_vec) {
    T r;
    for (int i = 0; i < vinfo<T>::n; ++i) r[i] = c[i] ? b[i] : a[i];
    return r;
  } else {
    return c ? b : a;
  }
}
template <typename T>
inline bool isnan(T x) { return __builtin_isnan((float)x); }
template <typename T>
inline bool isinf(T x) { return __builtin_isinf((float)x); }
template <typename T>
inline bool isfinite(T x) { return __builtin_isfinite((float)x); }
template <typename T>
inline bool signbit(T x) { return __builtin_signbit((float)x); }
template <typename T>
inline T sign(T x) { return x > T(0) ? T(1) : (x < T(0) ? T(-1) : T(0)); }
template <typename T>
inline T step(T edge, T x) { return x < edge ? T(0) : T(1); }
template <typename T>
inline typename vinfo<T>::elem dot(T a, T b) {
  typename vinfo<T>::elem s = a[0] * b[0];
  for (int i = 1; i < vinfo<T>::n; ++i) s = s + a[i] * b[i];
  return s;
}
template <typename T>
inline bool all(T x) {
  if constexpr (vinfo<T>::is_vec) { for (int i = 0; i < vinfo<T>::n; ++i) if (!x[i]) return false; return true; }
  else return bool(x);
}
template <typename T>
inline bool any(T x) {
  if constexpr (vinfo<T>::is_vec) { for (int i = 0; i < vinfo<T>::n; ++i) if (x[i]) return true; return false; }
  else return bool(x);
}
template <typename T, enable_if_t<is_integral_v<T>, int> = 0>
inline T popcount(T x) { return (T)__builtin_popcountll((unsigned long long)(make_unsigned_t<T>)x); }
template <typename T, enable_if_t<is_integral_v<T>, int> = 0>
inline T clz(T x) { return x == 0 ? T(sizeof(T) * 8) : T(__builtin_clzll((unsigned long long)(make_unsigned_t<T>)x) - (64 - sizeof(T) * 8)); }
template <typename T, enable_if_t<is_integral_v<T>, int> = 0>
inline T ctz(T x) { return x == 0 ? T(sizeof(T) * 8) : T(__builtin_ctzll((unsigned long long)(make_unsigned_t<T>)x)); }
template <typename T, enable_if_t<is_integral_v<T>, int> = 0>
inline T mulhi(T a, T b) { return T(((__int128)a * (__int128)b) >> (sizeof(T) * 8)); }

namespace fast { MLXEMU_MATH_ALL(MLXEMU_MATH1, MLXEMU_MATH2) using metal::fma; using metal::max; using metal::min; using metal::clamp; }
namespace precise { MLXEMU_MATH_ALL(MLXEMU_MATH1, MLXEMU_MATH2) using metal::fma; using metal::max; using metal::min; using metal::clamp; }

// ---------------------------------------------------------------------------------------------
// Synchronisation
enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4, mem_threadgroup_imageblock = 8 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }
// The flags count: only mem_threadgroup orders threadgroup memory (runtime.cpp's race check).
inline void threadgroup_barrier(mem_flags f = mem_flags::mem_none, MLXEMU_SITE) { mlxemu_barrier(0, (int)f, MLXEMU_SITE_ARGS); }
inline void simdgroup_barrier(mem_flags f = mem_flags::mem_none, MLXEMU_SITE) { mlxemu_barrier(1, (int)f, MLXEMU_SITE_ARGS); }

enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release, memory_order_acq_rel, memory_order_seq_cst };
enum class thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };

// Atomics: threads never run concurrently (fibers), so plain operations are atomic.
template <typename T>
struct atomic { T v; };
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;

struct mlxemu_atomic_scope {
  mlxemu_atomic_scope() { mlxemu_atomic(1); }
  ~mlxemu_atomic_scope() { mlxemu_atomic(0); }
};
#define MLXEMU_ATOMIC_RMW(NAME, EXPR)                                        \
  template <typename P, typename U>                                          \
  inline auto NAME(P obj, U arg, memory_order = memory_order_relaxed) {      \
    mlxemu_atomic_scope scope_;                                              \
    using T = decltype(obj->v + 0);                                          \
    auto old = obj->v;                                                       \
    T a = (T)arg;                                                            \
    obj->v = (EXPR);                                                         \
    return old;                                                              \
  }
MLXEMU_ATOMIC_RMW(atomic_fetch_add_explicit, old + a)
MLXEMU_ATOMIC_RMW(atomic_fetch_sub_explicit, old - a)
MLXEMU_ATOMIC_RMW(atomic_fetch_max_explicit, old > a ? old : a)
MLXEMU_ATOMIC_RMW(atomic_fetch_min_explicit, old < a ? old : a)
MLXEMU_ATOMIC_RMW(atomic_fetch_and_explicit, old & a)
MLXEMU_ATOMIC_RMW(atomic_fetch_or_explicit, old | a)
MLXEMU_ATOMIC_RMW(atomic_fetch_xor_explicit, old ^ a)
MLXEMU_ATOMIC_RMW(atomic_exchange_explicit, a)
#undef MLXEMU_ATOMIC_RMW
template <typename P>
inline auto atomic_load_explicit(P obj, memory_order = memory_order_relaxed) { mlxemu_atomic_scope s_; return obj->v; }
template <typename P, typename U>
inline void atomic_store_explicit(P obj, U x, memory_order = memory_order_relaxed) { mlxemu_atomic_scope s_; obj->v = x; }
template <typename P, typename E, typename U>
inline bool atomic_compare_exchange_weak_explicit(P obj, E expected, U desired, memory_order = memory_order_relaxed, memory_order = memory_order_relaxed) {
  mlxemu_atomic_scope s_;
  if (obj->v == *expected) { obj->v = desired; return true; }
  *expected = obj->v;
  return false;
}

} // namespace metal

// ---------------------------------------------------------------------------------------------
// SIMD-group functions, as the `__metal_*` builtins MLX's bf16_math.h also calls.
enum {
  MLXEMU_K_SHUFFLE = 1, MLXEMU_K_REDUCE, MLXEMU_K_PREFIX, MLXEMU_K_VOTE, MLXEMU_K_FILL
};

template <typename T>
struct mlxemu_lanes {
  const T* v;   // the 32 lanes' values
  uint mask;    // active lanes
  uint lane;    // this lane
};
template <typename T>
inline mlxemu_lanes<T> mlxemu_sync(int kind, T x, const char* file, int line, int col) {
  static_assert(sizeof(T) <= 64, "SIMD value too large for the emulator");
  mlxemu_lanes<T> r;
  r.v = (const T*)mlxemu_simd_sync(kind, &x, (int)sizeof(T), &r.mask, &r.lane, file, line, col);
  return r;
}

inline ushort __metal_get_simdgroup_size(ushort) { return 32; }

template <typename T> inline T __metal_simd_broadcast(T x, ushort l, MLXEMU_SITE) { auto s = mlxemu_sync(MLXEMU_K_SHUFFLE, x, MLXEMU_SITE_ARGS); return s.v[l & 31]; }
template <typename T> inline T __metal_simd_shuffle(T x, ushort l, MLXEMU_SITE) { auto s = mlxemu_sync(MLXEMU_K_SHUFFLE, x, MLXEMU_SITE_ARGS); return s.v[l & 31]; }
template <typename T> inline T __metal_simd_shuffle_down(T x, ushort d, MLXEMU_SITE) { auto s = mlxemu_sync(MLXEMU_K_SHUFFLE, x, MLXEMU_SITE_ARGS); return s.lane + d < 32 ? s.v[s.lane + d] : x; }
template <typename T> inline T __metal_simd_shuffle_up(T x, ushort d, MLXEMU_SITE) { auto s = mlxemu_sync(MLXEMU_K_SHUFFLE, x, MLXEMU_SITE_ARGS); return s.lane >= d ? s.v[s.lane - d] : x; }
template <typename T> inline T __metal_simd_shuffle_xor(T x, ushort m, MLXEMU_SITE) { auto s = mlxemu_sync(MLXEMU_K_SHUFFLE, x, MLXEMU_SITE_ARGS); return s.v[(s.lane ^ m) & 31]; }
template <typename T> inline T __metal_simd_shuffle_rotate_down(T x, ushort d, MLXEMU_SITE) { auto s = mlxemu_sync(MLXEMU_K_SHUFFLE, x, MLXEMU_SITE_ARGS); return s.v[(s.lane + d) & 31]; }
template <typename T> inline T __metal_simd_shuffle_rotate_up(T x, ushort d, MLXEMU_SITE) { auto s = mlxemu_sync(MLXEMU_K_SHUFFLE, x, MLXEMU_SITE_ARGS); return s.v[(s.lane + 32 - (d & 31)) & 31]; }
template <typename T> struct mlxemu_pair { T a, b; };
template <typename T> inline T __metal_simd_shuffle_and_fill_down(T x, T fill, ushort d, ushort mod, MLXEMU_SITE) {
  auto s = mlxemu_sync(MLXEMU_K_FILL, mlxemu_pair<T>{x, fill}, MLXEMU_SITE_ARGS);
  uint base = s.lane - s.lane % mod, i = s.lane % mod + d;
  return i < mod ? s.v[base + i].a : s.v[base + i - mod].b;
}
template <typename T> inline T __metal_simd_shuffle_and_fill_up(T x, T fill, ushort d, ushort mod, MLXEMU_SITE) {
  auto s = mlxemu_sync(MLXEMU_K_FILL, mlxemu_pair<T>{x, fill}, MLXEMU_SITE_ARGS);
  uint base = s.lane - s.lane % mod, i = s.lane % mod;
  return i >= d ? s.v[base + i - d].a : s.v[base + i + mod - d].b;
}

// Bitwise ops; on floats they act on the bit patterns (MLX instantiates them for bfloat).
template <typename T> inline T mlxemu_bits(T a, T b, int op) {
  if constexpr (metal::is_floating_point_v<T>) {
    using U = metal::conditional_t<sizeof(T) == 2, ushort, uint>;
    U x = __builtin_bit_cast(U, a), y = __builtin_bit_cast(U, b);
    return __builtin_bit_cast(T, U(op == 0 ? (x & y) : op == 1 ? (x | y) : (x ^ y)));
  } else {
    return op == 0 ? T(a & b) : op == 1 ? T(a | b) : T(a ^ b);
  }
}

// Reductions fold the active lanes in lane order.
#define MLXEMU_SIMD_REDUCE(NAME, OP)                                       \
  template <typename T> inline T __metal_simd_##NAME(T x, MLXEMU_SITE) {                \
    auto s = mlxemu_sync(MLXEMU_K_REDUCE, x, MLXEMU_SITE_ARGS);                              \
    bool first = true; T r = x;                                            \
    for (int i = 0; i < 32; ++i) if (s.mask >> i & 1) {                    \
      if (first) { r = s.v[i]; first = false; } else { T a = r, b = s.v[i]; r = (OP); } \
    }                                                                      \
    return r;                                                              \
  }
MLXEMU_SIMD_REDUCE(sum, a + b)
MLXEMU_SIMD_REDUCE(product, a * b)
MLXEMU_SIMD_REDUCE(max, metal::max(a, b))
MLXEMU_SIMD_REDUCE(min, metal::min(a, b))
MLXEMU_SIMD_REDUCE(and, mlxemu_bits(a, b, 0))
MLXEMU_SIMD_REDUCE(or, mlxemu_bits(a, b, 1))
MLXEMU_SIMD_REDUCE(xor, mlxemu_bits(a, b, 2))
#undef MLXEMU_SIMD_REDUCE

#define MLXEMU_SIMD_PREFIX(NAME, OP, INCL, ID)                             \
  template <typename T> inline T __metal_simd_prefix_##NAME(T x, MLXEMU_SITE) {         \
    auto s = mlxemu_sync(MLXEMU_K_PREFIX, x, MLXEMU_SITE_ARGS);                              \
    T r = T(ID);                                                           \
    for (uint i = 0; i < s.lane + (INCL); ++i) if (s.mask >> i & 1) { T a = r, b = s.v[i]; r = (OP); } \
    return r;                                                              \
  }
MLXEMU_SIMD_PREFIX(inclusive_sum, a + b, 1, 0)
MLXEMU_SIMD_PREFIX(exclusive_sum, a + b, 0, 0)
MLXEMU_SIMD_PREFIX(inclusive_product, a * b, 1, 1)
MLXEMU_SIMD_PREFIX(exclusive_product, a * b, 0, 1)
#undef MLXEMU_SIMD_PREFIX

namespace metal {
struct simd_vote {
  typedef ulong vote_t;
  vote_t v;
  explicit constexpr simd_vote(vote_t x = 0) : v(x) {}
  explicit operator vote_t() const { return v; }
  bool all() const { return v == 0xFFFFFFFFull; }
  bool any() const { return v != 0; }
};
#define MLXEMU_FWD1(NAME) template <typename T> inline T simd_##NAME(T x, MLXEMU_SITE) { return __metal_simd_##NAME(x, MLXEMU_SITE_ARGS); }
#define MLXEMU_FWD2(NAME) template <typename T> inline T simd_##NAME(T x, ushort d, MLXEMU_SITE) { return __metal_simd_##NAME(x, d, MLXEMU_SITE_ARGS); }
MLXEMU_FWD2(broadcast) MLXEMU_FWD2(shuffle) MLXEMU_FWD2(shuffle_down) MLXEMU_FWD2(shuffle_up)
MLXEMU_FWD2(shuffle_xor) MLXEMU_FWD2(shuffle_rotate_down) MLXEMU_FWD2(shuffle_rotate_up)
MLXEMU_FWD1(sum) MLXEMU_FWD1(product) MLXEMU_FWD1(max) MLXEMU_FWD1(min) MLXEMU_FWD1(and)
MLXEMU_FWD1(or) MLXEMU_FWD1(xor) MLXEMU_FWD1(prefix_inclusive_sum) MLXEMU_FWD1(prefix_exclusive_sum)
MLXEMU_FWD1(prefix_inclusive_product) MLXEMU_FWD1(prefix_exclusive_product)
#undef MLXEMU_FWD1
#undef MLXEMU_FWD2
template <typename T> inline T simd_shuffle_and_fill_down(T x, T f, ushort d, ushort m, MLXEMU_SITE) { return __metal_simd_shuffle_and_fill_down(x, f, d, m, MLXEMU_SITE_ARGS); }
template <typename T> inline T simd_shuffle_and_fill_down(T x, T f, ushort d, MLXEMU_SITE) { return __metal_simd_shuffle_and_fill_down(x, f, d, (ushort)32, MLXEMU_SITE_ARGS); }
template <typename T> inline T simd_shuffle_and_fill_up(T x, T f, ushort d, ushort m, MLXEMU_SITE) { return __metal_simd_shuffle_and_fill_up(x, f, d, m, MLXEMU_SITE_ARGS); }
template <typename T> inline T simd_shuffle_and_fill_up(T x, T f, ushort d, MLXEMU_SITE) { return __metal_simd_shuffle_and_fill_up(x, f, d, (ushort)32, MLXEMU_SITE_ARGS); }
template <typename T> inline T simd_broadcast_first(T x, MLXEMU_SITE) {
  auto s = mlxemu_sync(MLXEMU_K_SHUFFLE, x, MLXEMU_SITE_ARGS);
  return s.v[__builtin_ctz(s.mask)];
}
inline simd_vote simd_ballot(bool b, MLXEMU_SITE) {
  auto s = mlxemu_sync(MLXEMU_K_VOTE, (uint)b, MLXEMU_SITE_ARGS);
  ulong m = 0;
  for (int i = 0; i < 32; ++i) if ((s.mask >> i & 1) && s.v[i]) m |= 1ull << i;
  return simd_vote(m);
}
inline bool simd_all(bool b, MLXEMU_SITE) {
  auto s = mlxemu_sync(MLXEMU_K_VOTE, (uint)b, MLXEMU_SITE_ARGS);
  for (int i = 0; i < 32; ++i) if ((s.mask >> i & 1) && !s.v[i]) return false;
  return true;
}
inline bool simd_any(bool b, MLXEMU_SITE) {
  auto s = mlxemu_sync(MLXEMU_K_VOTE, (uint)b, MLXEMU_SITE_ARGS);
  for (int i = 0; i < 32; ++i) if ((s.mask >> i & 1) && s.v[i]) return true;
  return false;
}
inline simd_vote simd_active_threads_mask(MLXEMU_SITE) { auto s = mlxemu_sync(MLXEMU_K_VOTE, 0u, MLXEMU_SITE_ARGS); return simd_vote(s.mask); }
inline bool simd_is_first(MLXEMU_SITE) { auto s = mlxemu_sync(MLXEMU_K_VOTE, 0u, MLXEMU_SITE_ARGS); return s.lane == (uint)__builtin_ctz(s.mask); }

// Quad-group functions (groups of 4 lanes). They synchronise the whole SIMD group, which is
// stricter than Metal where only the quad must converge.
template <typename T> inline T quad_shuffle(T x, ushort l, MLXEMU_SITE) { auto s = mlxemu_sync(MLXEMU_K_SHUFFLE, x, MLXEMU_SITE_ARGS); return s.v[(s.lane & ~3u) | (l & 3u)]; }
template <typename T> inline T quad_broadcast(T x, ushort l, MLXEMU_SITE) { auto s = mlxemu_sync(MLXEMU_K_SHUFFLE, x, MLXEMU_SITE_ARGS); return s.v[(s.lane & ~3u) | (l & 3u)]; }
template <typename T> inline T quad_shuffle_xor(T x, ushort m, MLXEMU_SITE) { auto s = mlxemu_sync(MLXEMU_K_SHUFFLE, x, MLXEMU_SITE_ARGS); return s.v[(s.lane & ~3u) | ((s.lane ^ m) & 3u)]; }
template <typename T> inline T quad_shuffle_down(T x, ushort d, MLXEMU_SITE) { auto s = mlxemu_sync(MLXEMU_K_SHUFFLE, x, MLXEMU_SITE_ARGS); return (s.lane & 3u) + d < 4 ? s.v[s.lane + d] : x; }
template <typename T> inline T quad_shuffle_up(T x, ushort d, MLXEMU_SITE) { auto s = mlxemu_sync(MLXEMU_K_SHUFFLE, x, MLXEMU_SITE_ARGS); return (s.lane & 3u) >= d ? s.v[s.lane - d] : x; }
#define MLXEMU_QUAD_REDUCE(NAME, OP)                                                     \
  template <typename T> inline T quad_##NAME(T x, MLXEMU_SITE) {                         \
    auto s = mlxemu_sync(MLXEMU_K_REDUCE, x, MLXEMU_SITE_ARGS);                          \
    T r = x; bool first = true;                                                          \
    for (uint i = s.lane & ~3u; i < (s.lane & ~3u) + 4; ++i) if (s.mask >> i & 1) {       \
      if (first) { r = s.v[i]; first = false; } else { T a = r, b = s.v[i]; r = (OP); }  \
    }                                                                                    \
    return r;                                                                            \
  }
MLXEMU_QUAD_REDUCE(sum, a + b)
MLXEMU_QUAD_REDUCE(product, a * b)
MLXEMU_QUAD_REDUCE(max, metal::max(a, b))
MLXEMU_QUAD_REDUCE(min, metal::min(a, b))
#undef MLXEMU_QUAD_REDUCE
} // namespace metal

// Metal's functional-cast vector constructors: `float4(a, b, c, d)`, `float4(x)`, `half4(v)`.
// Function-like macros only fire when the name is followed by `(`, so `float4 x;` is untouched.
#define float2(...) metal::mlxemu_make<float, 2>(__VA_ARGS__)
#define float3(...) metal::mlxemu_make<float, 3>(__VA_ARGS__)
#define float4(...) metal::mlxemu_make<float, 4>(__VA_ARGS__)
#define half2(...) metal::mlxemu_make<half, 2>(__VA_ARGS__)
#define half3(...) metal::mlxemu_make<half, 3>(__VA_ARGS__)
#define half4(...) metal::mlxemu_make<half, 4>(__VA_ARGS__)
#define bfloat2(...) metal::mlxemu_make<bfloat, 2>(__VA_ARGS__)
#define bfloat3(...) metal::mlxemu_make<bfloat, 3>(__VA_ARGS__)
#define bfloat4(...) metal::mlxemu_make<bfloat, 4>(__VA_ARGS__)
#define int2(...) metal::mlxemu_make<int, 2>(__VA_ARGS__)
#define int3(...) metal::mlxemu_make<int, 3>(__VA_ARGS__)
#define int4(...) metal::mlxemu_make<int, 4>(__VA_ARGS__)
#define uint2(...) metal::mlxemu_make<uint, 2>(__VA_ARGS__)
#define uint3(...) metal::mlxemu_make<uint, 3>(__VA_ARGS__)
#define uint4(...) metal::mlxemu_make<uint, 4>(__VA_ARGS__)

// <metal_simdgroup_matrix>: 8x8 SIMD-group matrices (a separate header, same invariants).
#include "metal_simdgroup_matrix.h"

using namespace metal;

// MSL has no double (lower.py makes unsuffixed literals float) and no C++ standard library:
// code after this point that uses either fails here as it would fail on a Mac.
#pragma clang poison double std
