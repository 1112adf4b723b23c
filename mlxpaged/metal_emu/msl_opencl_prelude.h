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
#define __METAL_VERSION__ 310

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
// MLX's spellings of the kernel's element types. half arithmetic needs cl_khr_fp16, which
// -cl-ext=-all turns off: _Float16 stands in for half values.
typedef _Float16 float16_t;
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

template <typename T> T min(T a, T b);
template <typename T> T max(T a, T b);
template <typename T> T clamp(T x, T lo, T hi);
template <typename T> T fabs(T x);
template <typename T> T abs(T x);
template <typename T> T exp(T x);
template <typename T> T exp2(T x);
template <typename T> T log(T x);
template <typename T> T log2(T x);
template <typename T> T sqrt(T x);
template <typename T> T rsqrt(T x);
template <typename T> T fma(T a, T b, T c);
template <typename T> T select(T a, T b, bool c);
namespace fast {
template <typename T> T exp(T x);
template <typename T> T exp2(T x);
template <typename T> T log2(T x);
template <typename T> T rsqrt(T x);
}  // namespace fast
namespace precise {
template <typename T> T exp(T x);
template <typename T> T exp2(T x);
}  // namespace precise

template <typename T> T simd_shuffle(T x, ushort lane);
template <typename T> T simd_shuffle_xor(T x, ushort mask);
template <typename T> T simd_shuffle_down(T x, ushort delta);
template <typename T> T simd_shuffle_up(T x, ushort delta);
template <typename T> T simd_broadcast(T x, ushort lane);
template <typename T> T simd_sum(T x);
template <typename T> T simd_max(T x);
template <typename T> T simd_min(T x);
template <typename T> T simd_prefix_exclusive_sum(T x);

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
typedef simdgroup_matrix<float16_t, 8, 8> simdgroup_half8x8;
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
