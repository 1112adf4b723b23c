// metal_simdgroup_matrix.h: Metal's <metal_simdgroup_matrix> (8x8 SIMD-group matrices) for the
// MSL emulator. Included by metal_shim.h (so `#include <metal_simdgroup_matrix>` and
// `<metal_stdlib>` both reach it).
//
// Invariants:
//  * A simdgroup_matrix<T, 8, 8> is distributed over the 32 lanes, 2 elements per lane
//    (`thread_elements()`), in the layout MLX's steel GEMM relies on: lane l holds row
//    fm = (qid & 4) + (l / 2) % 4 and columns fn, fn + 1 with fn = (qid & 2) * 2 + (l % 2) * 2,
//    qid = l / 4 (mlx/backend/metal/kernels/steel/gemm/mma.h, BaseMMAFrag<T, 8, 8>::get_coord).
//  * simdgroup_load / simdgroup_store / simdgroup_multiply(_accumulate) are collective: every
//    lane of the simdgroup must call them at the same call site (runtime.cpp's SIMD sync), and
//    all 32 lanes must be active; anything else is a MetalEmuError, like a barrier in divergent
//    control flow. A load or store runs after the sync, each lane moving its own 2 elements
//    with ordinary (traced) loads and stores, so the byte counters count 64 elements per call.
//  * Addressing: the 8x8 window of the source starts at element
//    `origin.y * elements_per_row + origin.x` (origin is (column, row) of the memory layout);
//    without transpose M[r][c] = window[r * elements_per_row + c], with it
//    M[r][c] = window[c * elements_per_row + r]. Kernels that want to be independent of how
//    Metal applies the origin under transpose offset the pointer and pass origin 0.
//  * simdgroup_multiply_accumulate(D, A, B, C): D = A * B + C, each element computed in fp32
//    as C[r][c] + A[r][0] B[0][c] + ... + A[r][7] B[7][c] (in that order, no FMA), rounded once to
//    D's element type. The four matrices may have different element types.
//  * Cost model (LaunchStats): simdgroup_mma, simdgroup_matrix_loads and
//    simdgroup_matrix_stores count simdgroup-wide calls.
#pragma once

extern "C" {
void mlxemu_fail(const char* msg);  // report an error from kernel code and stop the thread
unsigned int mlxemu_lane(void);     // thread_index_in_simdgroup of the running thread
// This lane's 2 elements of A * B + C from the 32 lanes' {a0, a1, b0, b1, c0, c1} (runtime.cpp).
void mlxemu_mma8x8(const float* in, unsigned int lane, float* out);
}

enum { MLXEMU_K_MLOAD = 6, MLXEMU_K_MSTORE = 7, MLXEMU_K_MMA = 8 };

#define ulong2(...) metal::mlxemu_make<ulong, 2>(__VA_ARGS__)

namespace metal {

// (row, column) of lane `l`'s first element; its second is (row, column + 1).
inline void mlxemu_mat_coord(uint l, int* row, int* col) {
  const int qid = (int)l / 4;
  *row = (qid & 4) + ((int)l / 2) % 4;
  *col = (qid & 2) * 2 + ((int)l % 2) * 2;
}

template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator supports 8x8 simdgroup matrices only");
  static_assert(is_floating_point_v<T>, "simdgroup_matrix elements are float, half or bfloat");
  vec<T, 2> mlxemu_e;  // this lane's two elements

  simdgroup_matrix() = default;
  // Metal: a diagonal matrix with `d` on the diagonal, zero elsewhere.
  explicit simdgroup_matrix(T d) {
    int r, c;
    mlxemu_mat_coord(mlxemu_lane(), &r, &c);
    mlxemu_e[0] = r == c ? d : T(0);
    mlxemu_e[1] = r == c + 1 ? d : T(0);
  }
  vec<T, 2>& thread_elements() { return mlxemu_e; }
  const vec<T, 2>& thread_elements() const { return mlxemu_e; }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <typename T, int Cols, int Rows>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.mlxemu_e = vec<T, 2>(value);
  return m;
}

// The collective part of every matrix operation: all 32 lanes at one call site.
template <typename P>
inline mlxemu_lanes<P> mlxemu_mat_sync(int kind, P payload, const char* file, int line, int col) {
  auto s = mlxemu_sync(kind, payload, file, line, col);
  if (s.mask != 0xFFFFFFFFu) {
    mlxemu_fail(kind == MLXEMU_K_MMA ? "simdgroup_multiply_accumulate with inactive lanes: all 32 "
                                       "lanes of the simdgroup must call it (divergent control flow)"
                                     : "simdgroup_load/simdgroup_store with inactive lanes: all 32 "
                                       "lanes of the simdgroup must call it (divergent control flow)");
  }
  return s;
}

// Element offset of M[r][c] in the source/destination layout.
inline ulong mlxemu_mat_off(int r, int c, ulong epr, ulong2 origin, bool transpose) {
  const ulong base = origin.y * epr + origin.x;
  return transpose ? base + (ulong)c * epr + (ulong)r : base + (ulong)r * epr + (ulong)c;
}

template <typename T, int C, int R, typename P>
inline void simdgroup_load(thread simdgroup_matrix<T, C, R>& d, P src, ulong elements_per_row = C,
                           ulong2 matrix_origin = 0, bool transpose_matrix = false, MLXEMU_SITE) {
  auto s = mlxemu_mat_sync(MLXEMU_K_MLOAD, 0u, MLXEMU_SITE_ARGS);
  int r, c;
  mlxemu_mat_coord(s.lane, &r, &c);
  for (int i = 0; i < 2; ++i)
    d.mlxemu_e[i] = static_cast<T>(src[mlxemu_mat_off(r, c + i, elements_per_row, matrix_origin, transpose_matrix)]);
}

template <typename T, int C, int R, typename P>
inline void simdgroup_store(thread const simdgroup_matrix<T, C, R>& a, P dst, ulong elements_per_row = C,
                            ulong2 matrix_origin = 0, bool transpose_matrix = false, MLXEMU_SITE) {
  auto s = mlxemu_mat_sync(MLXEMU_K_MSTORE, 0u, MLXEMU_SITE_ARGS);
  int r, c;
  mlxemu_mat_coord(s.lane, &r, &c);
  for (int i = 0; i < 2; ++i)
    dst[mlxemu_mat_off(r, c + i, elements_per_row, matrix_origin, transpose_matrix)] = a.mlxemu_e[i];
}

// What each lane publishes for a multiply-accumulate: its elements of A, B and C (exact in fp32);
// packed, 24 bytes, so the runtime reads the 32 records as floats [32][6].
struct mlxemu_mma_in {
  float a[2], b[2], c[2];
};

template <typename TD, typename TA, typename TB, typename TC>
inline void simdgroup_multiply_accumulate(thread simdgroup_matrix<TD, 8, 8>& d,
                                          thread const simdgroup_matrix<TA, 8, 8>& a,
                                          thread const simdgroup_matrix<TB, 8, 8>& b,
                                          thread const simdgroup_matrix<TC, 8, 8>& c, MLXEMU_SITE) {
  mlxemu_mma_in in;
  for (int i = 0; i < 2; ++i) {
    in.a[i] = (float)a.mlxemu_e[i];
    in.b[i] = (float)b.mlxemu_e[i];
    in.c[i] = (float)c.mlxemu_e[i];
  }
  auto s = mlxemu_mat_sync(MLXEMU_K_MMA, in, MLXEMU_SITE_ARGS);
  float o[2];  // computed by the runtime (untraced: the gather of A's row and B's columns)
  mlxemu_mma8x8(&s.v[0].a[0], s.lane, o);
  for (int i = 0; i < 2; ++i) d.mlxemu_e[i] = static_cast<TD>(o[i]);
}

template <typename TD, typename TA, typename TB>
inline void simdgroup_multiply(thread simdgroup_matrix<TD, 8, 8>& d,
                               thread const simdgroup_matrix<TA, 8, 8>& a,
                               thread const simdgroup_matrix<TB, 8, 8>& b, MLXEMU_SITE) {
  const simdgroup_matrix<TD, 8, 8> zero = make_filled_simdgroup_matrix<TD, 8, 8>(TD(0));
  simdgroup_multiply_accumulate(d, a, b, zero, MLXEMU_SITE_ARGS);
}

}  // namespace metal
