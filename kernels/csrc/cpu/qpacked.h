// Block-format weights repacked once at load for the products (ggml's CPU_REPACK idea): the
// rows of a matrix go in groups of PACK_ROWS = 8, and each block of a group holds its 8 rows'
// values interleaved so that one 32-byte vector carries 4 consecutive values of each of the 8
// rows: the weights are the vector operand of the byte products and 4 bytes of an activation
// row are broadcast against them, so the sums of the 8 rows leave as one vector of 8 outputs
// with no horizontal additions, and a vector of weights meets every activation row of the step
// once it is in a register. Nothing is unpacked per call but nibbles and high bits, in
// registers. A group's block takes exactly the bytes of its 8 rows' blocks in the file, so a
// repacked matrix keeps its size and its [rows, row bytes] shape:
//   values: per octet t of 8 values (k = 8t .. 8t + 7), byte 4r + i of 32 holds row r's values
//     8t + i (low nibble) and 8t + 4 + i (high nibble) for 4-6 bit formats; 8-bit q8_0 keeps
//     the two 32-byte halves whole. 5-bit formats add per octet two 32-bit masks of fifth bits
//     (bit 4r + i), 6-bit q6_k 16 bytes of nibbles holding each position's two high-bit pairs
//     (position p's in byte p % 16, low nibble for p < 16).
//   scales after the values: the rows' fp16 d (and m, or dmin for the K formats); q4_k/q5_k's
//     6-bit sub-scales and mins as 64 bytes of sc | (mn & 3) << 6 and 32 of mn >> 2 nibbles,
//     sub-block-major; q6_k's int8 scales sub-block-major.
#pragma once

#include <cstdint>

#include "qlinear.h"

namespace kvserve {

constexpr int64_t PACK_ROWS = 8;
// Added to a GGML type id where a part's rows are repacked (what the Python side passes).
constexpr int64_t PACKED = 256;

constexpr bool is_packed(int64_t type) { return type >= PACKED; }

// src [rows, row_bytes] in GGML type `type`, as the file stores it, into dst (as many bytes),
// rows a multiple of PACK_ROWS.
void repack(int64_t type, const uint8_t* src, int64_t rows, int64_t row_bytes, uint8_t* dst);

// Row r of a repacked matrix (GGML type `type`, rows of row_bytes bytes) as floats, K of them.
void dequantize_packed(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t r, float* out);

// Weight rows a tile of the products reads side by side for M input rows (a multiple of
// PACK_ROWS): the chunks the threads take are best whole tiles.
int64_t packed_tile_rows(int64_t M);

// As quant_rows (qlinear.h) for a repacked part (p.type without PACKED): y[m][n] for n in
// [r0, r1), both multiples of PACK_ROWS, and the M rows of xq, in panels.
void packed_products(const QuantPart& p, const QPanels& xq, int64_t M, int64_t r0, int64_t r1,
                     float* y, int64_t ldy);

}  // namespace kvserve
