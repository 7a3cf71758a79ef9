// Products with weights in GGUF block formats (qformats.h), on activations rounded to 8 bits
// per block of 32 (QRows): integer dot products per unit of 32 values, scaled in float. Each
// weight block is unpacked once and used against up to 8 activation rows; more rows go in
// groups of 8 over a chunk of weight rows, which the groups read from L2.
#pragma once

#include <cstdint>

namespace kvserve {

// Activations x [M, K] rounded to two int8 digits, x = d (DIGIT_BASE q + ql) (quantize_row),
// d the low digit's step, one per group of 32 values (Q8_0's grouping) or, for a matrix with
// K-format parts, of KGROUP values, over which the products of those formats sum in integers
// with the formats' integer sub-scales (as llama.cpp's Q8_K does over 256; 64 rounds outliers
// of a few channels with fewer of their neighbours): row m's digits q + m K and ql + m K, steps
// d + m K / 32 (one per 32, equal within a group), and the sums of its values per 32 (s32) and
// per 16 (s16), which the weights' offsets multiply. Each product is the high digit's integer
// sum times DIGIT_BASE plus the low digit's.
constexpr int64_t KGROUP = 64;

struct QRows {
  int8_t *q, *ql;
  float *d, *s32, *s16;
  int64_t K;

  // Bytes of the rounded rows of x [M, K].
  static int64_t bytes(int64_t M, int64_t K) {
    return 2 * M * K + M * (K / 32) * 8 + M * (K / 16) * 4;
  }

  // The view of `bytes(M, K)` bytes at p (64-byte aligned) for rows of K values.
  static QRows at(void* p, int64_t M, int64_t K) {
    int8_t* q = static_cast<int8_t*>(p);
    float* d = reinterpret_cast<float*>(q + 2 * M * K);
    return {q, q + M * K, d, d + M * (K / 32), d + 2 * M * (K / 32), K};
  }
};

// x [M, K] rounded into xq with a scale per `group` values (32 or KGROUP, dividing K).
void quantize_rows(const float* x, int64_t M, int64_t group, const QRows& xq);

// QRows rearranged for many rows (more than 8, qtiles.cpp): panels of 8 rows, panel g's digits
// q + g 8 K and ql + g 8 K as [K / 4][8 rows][4 values] (a vector holds 4 values of each of 8
// rows), its scales and sums d, s32 + g 8 K / 32 as [K / 32][8 rows], s16 + g 8 K / 16 as
// [K / 16][8 rows]; zero for rows past M.
struct QPanels {
  int8_t *q, *ql;
  float *d, *s32, *s16;
  int64_t K, panels;

  static int64_t bytes(int64_t M, int64_t K) {
    return (M + 7) / 8 * 8 * (2 * K + K / 32 * 8 + K / 16 * 4);
  }

  static QPanels at(void* p, int64_t M, int64_t K) {
    const int64_t rows = (M + 7) / 8 * 8;
    int8_t* q = static_cast<int8_t*>(p);
    float* d = reinterpret_cast<float*>(q + 2 * rows * K);
    return {q, q + rows * K, d, d + rows * (K / 32), d + 2 * rows * (K / 32), K, rows / 8};
  }
};

void pack_panels(const QRows& xq, int64_t M, const QPanels& xp);

// Up to few_rows(type) input rows, a part of GGML type `type` goes a weight row at a time
// against the rows (quant_rows); more go through weight rows unpacked once and register tiles
// (quant_tiles), which cost less per input row from there on (bench.qgemm: from 5 rows for the
// 32-value formats, whose rows pay a float scale per 32 values, from 6 for the K formats, whose
// integer sub-scales keep a row's products in integers over 64). QFEW, the fewest of those,
// decides whether the input is packed for tiles at all.
constexpr int64_t QFEW = 4;
int64_t few_rows(int64_t type);

// Bytes of weight rows requested into L2 ahead of the row being multiplied or unpacked. A row
// is short (864 bytes for 1536 Q4_K values) and its products take long enough that the
// hardware prefetchers alone left one input row at a third of the read bandwidth from DRAM.
constexpr int64_t PREFETCH_BYTES = 4096;

// One part of a matrix in block format `type` (a GGML type id): rows of row_bytes bytes.
struct QuantPart {
  const uint8_t* w;
  int64_t row_bytes, type;
};

// Whether the kernels read GGML type `type`, and its values and bytes per block.
bool known_format(int64_t type);
int64_t block_values(int64_t type);
int64_t block_bytes(int64_t type);

// y[m][n] = dot(x[m], w[n]) for rows n in [r0, r1) of the part and the M rows of xq; y's rows
// ldy apart.
void quant_rows(const QuantPart& p, const QRows& xq, int64_t M, int64_t r0, int64_t r1, float* y,
                int64_t ldy);

// Bytes of the space a thread unpacks weight rows of K values into, for quant_tiles.
int64_t unpack_bytes(int64_t K);

// Whether quant_tiles reads the format: all, but q8_0 only where the byte products take
// unsigned bytes above 127 (VNNI; its values go offset by 128).
bool tiles_read(int64_t type);

// As quant_rows, for many rows: the rows of xp's panels against weight rows unpacked a few at
// a time into `scratch` (unpack_bytes), in register tiles that reuse each unpacked value and
// each activation vector several times.
void quant_tiles(const QuantPart& p, const QPanels& xp, int64_t M, int64_t r0, int64_t r1,
                 float* y, int64_t ldy, uint8_t* scratch);

}  // namespace kvserve
