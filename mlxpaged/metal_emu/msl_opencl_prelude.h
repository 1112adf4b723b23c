// msl_opencl_prelude.h: the Metal Shading Language names our kernels use, mapped onto C++ for
// OpenCL 2021 (clang -x cl -cl-std=clc++2021 -cl-ext=-all), for the front-end check
// (frontend.py). Declarations only: nothing here runs. Clang then enforces the rules MSL
// shares with OpenCL C++: `half` is a keyword, pointers and references live in an address
// space, no casts between address spaces, program-scope variables are `constant`, threadgroup
// (local) storage only at a kernel's outermost scope, no exceptions or dynamic allocation.
#define device __global
#define threadgroup __local
#define constant __constant
#define thread __private
// MSL's bfloat is a type keyword, as half is: a variable cannot be named after it.
#define bfloat __bf16
#define METAL_FUNC inline
// __METAL_VERSION__ comes from the command line: each check runs as MSL 3.2 and 4.0 (frontend.py).

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef unsigned long size_t;
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
// MLX's spellings of the kernel's element types. `half` is OpenCL's own (cl_khr_fp16, which
// frontend.py enables): half variables, arithmetic and `1.0h` literals, as in MSL.
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
typedef half float16_t;
typedef __bf16 bfloat16_t;

namespace metal {
template <typename T, int N>
using vec = T __attribute__((ext_vector_type(N)));
}  // namespace metal

#define MSLFE_VEC(T)                        \
  typedef metal::vec<T, 2> T##2;            \
  typedef metal::vec<T, 3> T##3;            \
  typedef metal::vec<T, 4> T##4;
MSLFE_VEC(float)
MSLFE_VEC(half)
MSLFE_VEC(bfloat)

MSLFE_VEC(int)
MSLFE_VEC(uint)
MSLFE_VEC(short)
MSLFE_VEC(ushort)
MSLFE_VEC(char)
MSLFE_VEC(uchar)
MSLFE_VEC(long)
MSLFE_VEC(ulong)


namespace metal {
template <typename T, int N>
struct mslfe_make {
  template <typename... A>
  vec<T, N> operator()(A... a) const { return vec<T, N>{static_cast<T>(a)...}; }
};
}  // namespace metal
// Metal's functional-cast vector constructors: float2(a, b).
#define float2(...) (metal::mslfe_make<float, 2>{}(__VA_ARGS__))
#define float4(...) (metal::mslfe_make<float, 4>{}(__VA_ARGS__))
#define uint2(...) (metal::mslfe_make<uint, 2>{}(__VA_ARGS__))
#define uint4(...) (metal::mslfe_make<uint, 4>{}(__VA_ARGS__))
#define ulong2(...) (metal::mslfe_make<ulong, 2>{}(__VA_ARGS__))

namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);

template <typename U, typename V>
U as_type(V v) { return __builtin_bit_cast(U, v); }

// MSL's concrete overloads (Metal Shading Language Specification, "Math functions",
// "Integer functions", "SIMD-group functions", "Atomic functions"), not templates over any type:
// a call MSL finds ambiguous (max(half, float), exp(int)) or has no overload for (simd_sum on a
// struct) fails here too. Scalars and vectors of 2, 3 and 4.
#define MSLFE_EACH_VEC(M, T) M(T) M(T##2) M(T##3) M(T##4)
#define MSLFE_EACH_FLOAT(M) MSLFE_EACH_VEC(M, float) MSLFE_EACH_VEC(M, half)
#define MSLFE_EACH_INT(M)                                                                      \
  MSLFE_EACH_VEC(M, char) MSLFE_EACH_VEC(M, uchar) MSLFE_EACH_VEC(M, short)                    \
  MSLFE_EACH_VEC(M, ushort) MSLFE_EACH_VEC(M, int) MSLFE_EACH_VEC(M, uint) MSLFE_EACH_VEC(M, long) \
  MSLFE_EACH_VEC(M, ulong)
// Arithmetic on every float and integer type.
#define MSLFE_MINMAX(T) T min(T a, T b); T max(T a, T b); T clamp(T x, T lo, T hi); T abs(T x);
MSLFE_EACH_FLOAT(MSLFE_MINMAX)
MSLFE_EACH_INT(MSLFE_MINMAX)
// Float math: float and half (bfloat has no math functions in MSL).
#define MSLFE_MATH(T)                                                                   \
  T fabs(T x); T exp(T x); T exp2(T x); T log(T x); T log2(T x); T sqrt(T x); T rsqrt(T x); \
  T fma(T a, T b, T c); T floor(T x); T ceil(T x);
MSLFE_EACH_FLOAT(MSLFE_MATH)
#define MSLFE_SELECT(T) T select(T a, T b, bool c);
MSLFE_EACH_FLOAT(MSLFE_SELECT)
MSLFE_EACH_INT(MSLFE_SELECT)
namespace fast {  // float only
#define MSLFE_FAST(T) T exp(T x); T exp2(T x); T log2(T x); T rsqrt(T x);
MSLFE_EACH_VEC(MSLFE_FAST, float)
}  // namespace fast
namespace precise {
#define MSLFE_PRECISE(T) T exp(T x); T exp2(T x);
MSLFE_EACH_VEC(MSLFE_PRECISE, float)
}  // namespace precise

// SIMD-group functions: scalars and vectors of float, half, int, uint, short, ushort, char,
// uchar (and bfloat from MSL 3.1 on); bool for the permutes.
#define MSLFE_SIMD_PERMUTE(T)                                                               \
  T simd_shuffle(T x, ushort lane); T simd_shuffle_xor(T x, ushort mask);                  \
  T simd_shuffle_down(T x, ushort delta); T simd_shuffle_up(T x, ushort delta);           \
  T simd_broadcast(T x, ushort lane);
#define MSLFE_SIMD_REDUCE(T) T simd_sum(T x); T simd_max(T x); T simd_min(T x); T simd_prefix_exclusive_sum(T x);
#define MSLFE_SIMD_TYPES(M)                                                                      \
  MSLFE_EACH_VEC(M, float) MSLFE_EACH_VEC(M, half) MSLFE_EACH_VEC(M, int) MSLFE_EACH_VEC(M, uint) \
  MSLFE_EACH_VEC(M, short) MSLFE_EACH_VEC(M, ushort) MSLFE_EACH_VEC(M, char) MSLFE_EACH_VEC(M, uchar)
MSLFE_SIMD_TYPES(MSLFE_SIMD_PERMUTE)
MSLFE_SIMD_TYPES(MSLFE_SIMD_REDUCE)
MSLFE_SIMD_PERMUTE(bool)
#if __METAL_VERSION__ >= 310
MSLFE_EACH_VEC(MSLFE_SIMD_PERMUTE, bfloat)
MSLFE_EACH_VEC(MSLFE_SIMD_REDUCE, bfloat)
#endif

// Atomics: atomic_int, atomic_uint (and atomic_float, MSL 3.0 on) in device or threadgroup
// memory. OpenCL's own atomic types (_Atomic(T)) stand in for MSL's.
enum memory_order { memory_order_relaxed = 0 };
#define MSLFE_ATOMIC_SPACE(AS, A, T)                                                            \
  void atomic_store_explicit(volatile AS A* a, T v, memory_order o);                           \
  T atomic_load_explicit(const volatile AS A* a, memory_order o);                              \
  T atomic_exchange_explicit(volatile AS A* a, T v, memory_order o);                           \
  T atomic_fetch_add_explicit(volatile AS A* a, T v, memory_order o);                          \
  T atomic_fetch_sub_explicit(volatile AS A* a, T v, memory_order o);                          \
  T atomic_fetch_max_explicit(volatile AS A* a, T v, memory_order o);                          \
  T atomic_fetch_min_explicit(volatile AS A* a, T v, memory_order o);                          \
  bool atomic_compare_exchange_weak_explicit(volatile AS A* a, thread T* expected, T desired, \
                                             memory_order s, memory_order f);
#define MSLFE_ATOMIC(A, T) MSLFE_ATOMIC_SPACE(device, A, T) MSLFE_ATOMIC_SPACE(threadgroup, A, T)
MSLFE_ATOMIC(atomic_int, int)
MSLFE_ATOMIC(atomic_uint, uint)
MSLFE_ATOMIC(atomic_float, float)

template <typename T> struct numeric_limits {
  static T max();
  static T min();
  static T lowest();
  static T infinity();
};

// simdgroup_matrix: an 8x8 fragment whose two elements per lane are thread_elements().
template <typename T, int R, int C>
struct simdgroup_matrix {
  vec<T, 2> mslfe_elements;
  vec<T, 2>& thread_elements() { return mslfe_elements; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat16_t, 8, 8> simdgroup_bfloat8x8;

template <typename T, int R, int C>
simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T value);
template <typename T, int R, int C, typename U>
void simdgroup_load(thread simdgroup_matrix<T, R, C>& d, const threadgroup U* src,
                    ulong elements_per_row = C, ulong2 origin = ulong2(0, 0),
                    bool transpose = false);
template <typename T, int R, int C, typename U>
void simdgroup_load(thread simdgroup_matrix<T, R, C>& d, const device U* src,
                    ulong elements_per_row = C, ulong2 origin = ulong2(0, 0),
                    bool transpose = false);
template <typename T, int R, int C, typename U>
void simdgroup_store(const thread simdgroup_matrix<T, R, C>& a, threadgroup U* dst,
                     ulong elements_per_row = C, ulong2 origin = ulong2(0, 0),
                     bool transpose = false);
template <typename T, int R, int C, typename U>
void simdgroup_store(const thread simdgroup_matrix<T, R, C>& a, device U* dst,
                     ulong elements_per_row = C, ulong2 origin = ulong2(0, 0),
                     bool transpose = false);
template <typename T, int R, int C>
void simdgroup_multiply_accumulate(thread simdgroup_matrix<T, R, C>& d,
                                   const thread simdgroup_matrix<T, R, C>& a,
                                   const thread simdgroup_matrix<T, R, C>& b,
                                   const thread simdgroup_matrix<T, R, C>& c);
}  // namespace metal
