// llama.cpp's block formats (GGUF's quantized types) multiplied as they are stored (cpu_blocks.cpp; the formats are
// written out in llmkit/quant/blocks.py).

#pragma once

#include "cpu_kernel.h"

#include <memory>

namespace llmkit {

// The block types by ggml's numbers for them (ggml.h's ggml_type).
enum BlockKind : int {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23,
  F16 = 1, BF16 = 30,  // half-width floats, held as stored too (blocks of 32 without a head, for the layout's sake)
};

// weights and bytes of one block of `kind`; false for a kind llmkit does not hold
bool block_layout(int kind, int64_t& weights, int64_t& bytes);

// A (N, K) matrix as rows of blocks as the GGUF file stores them, borrowed from a (N, K / weights * bytes) uint8
// tensor that must outlive it (a view of the file's memory map, often).
struct BlockMatrix {
  const uint8_t* data = nullptr;
  int kind = 0;
  int64_t N = 0, K = 0, row_bytes = 0;

  BlockMatrix rows(int64_t r0, int64_t r1) const { return {data + r0 * row_bytes, kind, r1 - r0, K, row_bytes}; }
};

BlockMatrix block_matrix(const torch::Tensor& blocks, int kind, int64_t K);

// Rows of x as the products take them. For the float types (F16, BF16: group 0) x itself, unrounded (xf). Else x
// rounded to int8 in groups of `group` inputs (32 for the 32-weight types, 256 for the K-quants, whose
// sub-block scales then apply in integers, as llama.cpp's Q8_K does), with each group's scale d, each 16 inputs' sum
// of codes (the terms of the types' mins and offsets), and -128 times each 4 codes' sum (VNNI's flipped codes).
// The wide kernels (cpu_blocks_wide.inc) also read the codes reordered to the order their weights' nibbles unpack in
// (alt, groups of 32): per 128 inputs the 16-byte pieces 0, 2, 4, 6, 1, 3, 5, 7 (4 bodies of 16 bytes of nibbles), and
// -128 times the sums of the 4 codes of alt's pieces i and i + 4 (a lane's two halves).
struct BlockRows {
  int64_t M = 0, K = 0, group = 32;
  const float* xf = nullptr;      // (M, K): group 0 (borrowed from the caller)
  std::vector<int8_t> q;          // (M, K)
  std::vector<float> d;           // (M, K / group)
  std::vector<int16_t> sums;      // (M, K / 16)
  std::vector<int32_t> flip;      // (M, K / 4), where the VNNI kernels run
  std::vector<int8_t> alt;        // (M, K), groups of 32, where the VNNI kernels run
  std::vector<int32_t> alt_flip;  // (M, K / 8), groups of 32, where the VNNI kernels run
};

// (decoding: with what the VNNI decoding kernels also read, flip and alt; rows in parallel)
void quantize_block_rows(const float* x, int64_t M, int64_t K, int64_t group, BlockRows& out, bool decoding = true);

// the activations' group for a block kind: 256 for the K-quants, 0 for the float types (x is not rounded), 32 for
// the others
int64_t activation_group(int kind);

// y[m, n - n0 + ...]: output columns [n0, n1) of x @ W^T for every row of x, y (M, ldy) row-major (column n at
// y + n). A row's result does not depend on the other rows, nor on how the columns are split.
void block_columns(const BlockMatrix& w, const BlockRows& x, int64_t n0, int64_t n1, float* y, int64_t ldy);

// Rows [n0, n1) of W dequantized: out (n1 - n0, K), fp32 or rounded to bf16 (at::BFloat16's bits).
void dequantize_block_rows(const BlockMatrix& w, int64_t n0, int64_t n1, float* out);
void dequantize_block_rows_bf16(const BlockMatrix& w, int64_t n0, int64_t n1, uint16_t* out);

// x @ W_i^T for several block matrices of the same K (any kinds), side by side: x is quantized once. With
// `panels`, where the integer kernel is AVX512-VNNI, every row is multiplied in integer panels
// (cpu_blocks_panels.inc) instead of the decoding kernels: the two give a row different bits, each the same at any
// number of rows.
class BlockProduct {
 public:
  void prepare(const float* x, int64_t M, int64_t K, const std::vector<BlockMatrix>& ws, bool panels = false);
  int64_t width() const { return starts_.back(); }
  void columns(int64_t j0, int64_t j1, float* y, int64_t ldy) const;

 private:
  const BlockRows& rows_for(int kind) const;

  BlockRows x32_, x256_, xf_;  // x in the groups the matrices' kinds take
  std::vector<BlockMatrix> ws_;
  std::vector<int64_t> starts_{0};
  std::vector<std::shared_ptr<const void>> panel_rows_;  // per matrix: x's side of its panels, or null
};

}  // namespace llmkit
