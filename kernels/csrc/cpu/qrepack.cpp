// Repacking block-format matrices at load, and reading single rows back (qpacked.h). Plain
// scalar code: it runs once per matrix, or per looked-up embedding row.
#include <cstring>

#include "qformats.h"
#include "qpacked.h"

namespace kvserve {
namespace {

// The layout, per format: values per block, bits per value, values per scale.

struct Shape {
  int64_t block, bits, sub;
  bool has_m;  // a second fp16 per row: q4_1/q5_1's m, q4_k/q5_k's dmin

  // Bytes of a group's values per block; its scales follow.
  int64_t value_bytes() const {
    return bits == 8 ? 8 * block : 4 * block + (bits == 5 ? block : bits == 6 ? 2 * block : 0);
  }
};

Shape shape_of(int64_t type) {
  switch (type) {
    case Q4_0::TYPE: return {32, 4, 32, false};
    case Q4_1::TYPE: return {32, 4, 32, true};
    case Q5_0::TYPE: return {32, 5, 32, false};
    case Q5_1::TYPE: return {32, 5, 32, true};
    case Q8_0::TYPE: return {32, 8, 32, false};
    case Q4_K::TYPE: return {256, 4, 32, true};
    case Q5_K::TYPE: return {256, 5, 32, true};
    case Q6_K::TYPE: return {256, 6, 16, false};
    default: return {0, 0, 0, false};
  }
}

// One block of the file decoded: its values as bytes (q8_0's as the bits of int8), the fp16
// bits of d and m (or dmin), and the K formats' sub-scales and mins (q6_k's int8 scales).
struct FileBlock {
  uint8_t q[256];
  uint16_t d = 0, m = 0;
  uint8_t sc[16] = {}, mn[16] = {};
};

uint16_t u16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

void nibbles_of(const uint8_t* p, uint8_t* q) {
  for (int i = 0; i < 16; ++i) q[i] = p[i] & 15, q[i + 16] = p[i] >> 4;
}

void fifth_bits_of(const uint8_t* p, uint8_t* q) {
  uint32_t h;
  std::memcpy(&h, p, 4);
  for (int i = 0; i < 32; ++i) q[i] |= ((h >> i) & 1) << 4;
}

// ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from 12 packed bytes.
void scale_min_k4(int j, const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = s[j] & 63, *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void decode(int64_t type, const uint8_t* p, FileBlock& f) {
  switch (type) {
    case Q4_0::TYPE: f.d = u16_at(p), nibbles_of(p + 2, f.q); break;
    case Q4_1::TYPE: f.d = u16_at(p), f.m = u16_at(p + 2), nibbles_of(p + 4, f.q); break;
    case Q5_0::TYPE: f.d = u16_at(p), nibbles_of(p + 6, f.q), fifth_bits_of(p + 2, f.q); break;
    case Q5_1::TYPE:
      f.d = u16_at(p), f.m = u16_at(p + 2), nibbles_of(p + 8, f.q), fifth_bits_of(p + 4, f.q);
      break;
    case Q8_0::TYPE: f.d = u16_at(p), std::memcpy(f.q, p + 2, 32); break;
    case Q4_K::TYPE:
    case Q5_K::TYPE: {
      const bool five = type == Q5_K::TYPE;
      f.d = u16_at(p), f.m = u16_at(p + 2);
      const uint8_t* qs = p + (five ? 48 : 16);
      for (int j = 0; j < 8; ++j) {
        scale_min_k4(j, p + 4, f.sc + j, f.mn + j);
        for (int l = 0; l < 32; ++l) {
          const int v = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
          f.q[32 * j + l] = static_cast<uint8_t>(v | (five ? ((p[16 + l] >> j) & 1) << 4 : 0));
        }
      }
      break;
    }
    case Q6_K::TYPE:
      f.d = u16_at(p + 208);
      for (int v = 0; v < 256; ++v) {
        const int h = v / 128, u = v % 128 / 32, l = v % 32;
        const int lo = (p[64 * h + 32 * (u % 2) + l] >> (4 * (u / 2))) & 15;
        const int hi = (p[128 + 32 * h + l] >> (2 * u)) & 3;
        f.q[v] = static_cast<uint8_t>(lo | hi << 4);
      }
      std::memcpy(f.sc, p + 192, 16);
      break;
    default: break;
  }
}

// A group's block from its 8 rows' blocks f, at o (8 file blocks' bytes).
void write_group_block(const Shape& s, const FileBlock* f, uint8_t* o) {
  const int64_t B = s.block;
  uint8_t* v = o;
  std::memset(o, 0, s.value_bytes());
  for (int64_t t = 0; t < B / 8; ++t)
    for (int r = 0; r < 8; ++r)
      for (int i = 0; i < 4; ++i) {
        const uint8_t a = f[r].q[8 * t + i], b = f[r].q[8 * t + 4 + i];
        const int p = 4 * r + i;
        if (s.bits == 8) {
          v[64 * t + p] = a, v[64 * t + 32 + p] = b;
          continue;
        }
        v[32 * t + p] = static_cast<uint8_t>((a & 15) | (b & 15) << 4);
        uint8_t* h = v + 4 * B;
        if (s.bits == 5) {
          h[8 * t + p / 8] |= static_cast<uint8_t>(((a >> 4) & 1) << (p % 8));
          h[8 * t + 4 + p / 8] |= static_cast<uint8_t>(((b >> 4) & 1) << (p % 8));
        } else if (s.bits == 6) {
          h[16 * t + p % 16] |= static_cast<uint8_t>(((a >> 4) | (b >> 4) << 2) << (p >= 16 ? 4 : 0));
        }
      }
  uint8_t* sc = o + s.value_bytes();
  for (int r = 0; r < 8; ++r) std::memcpy(sc + 2 * r, &f[r].d, 2);
  sc += 16;
  if (s.has_m) {
    for (int r = 0; r < 8; ++r) std::memcpy(sc + 2 * r, &f[r].m, 2);
    sc += 16;
  }
  if (s.block == 256 && s.bits != 6) {
    std::memset(sc, 0, 96);
    for (int j = 0; j < 8; ++j)
      for (int r = 0; r < 8; ++r) {
        const int p = 8 * j + r;
        sc[p] = static_cast<uint8_t>(f[r].sc[j] | (f[r].mn[j] & 3) << 6);
        sc[64 + p % 32] |= static_cast<uint8_t>((f[r].mn[j] >> 2) << (p >= 32 ? 4 : 0));
      }
  } else if (s.bits == 6) {
    for (int j = 0; j < 16; ++j)
      for (int r = 0; r < 8; ++r) sc[8 * j + r] = f[r].sc[j];
  }
}

}  // namespace

void repack(int64_t type, const uint8_t* src, int64_t rows, int64_t row_bytes, uint8_t* dst) {
  const Shape s = shape_of(type);
  const int64_t bytes = block_bytes(type), nb = row_bytes / bytes;
  FileBlock f[PACK_ROWS];
  for (int64_t g = 0; g < rows / PACK_ROWS; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t r = 0; r < PACK_ROWS; ++r) {
        f[r] = FileBlock{};
        decode(type, src + (g * PACK_ROWS + r) * row_bytes + b * bytes, f[r]);
      }
      write_group_block(s, f, dst + g * PACK_ROWS * row_bytes + b * PACK_ROWS * bytes);
    }
}

void dequantize_packed(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t r, float* out) {
  const Shape s = shape_of(type);
  const int64_t bytes = PACK_ROWS * block_bytes(type), nb = row_bytes / block_bytes(type);
  const int64_t rr = r % PACK_ROWS;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = w + r / PACK_ROWS * PACK_ROWS * row_bytes + b * bytes;
    const uint8_t* v = p;
    const uint8_t* sc = p + s.value_bytes();
    const float d = fp16_at(sc + 2 * rr), m = s.has_m ? fp16_at(sc + 16 + 2 * rr) : 0.f;
    for (int64_t k = 0; k < s.block; ++k) {
      const int64_t t = k / 8, i = k % 8 % 4, pos = 4 * rr + i;
      const bool second = k % 8 >= 4;
      int q;
      if (s.bits == 8) {
        q = static_cast<int8_t>(v[64 * t + 32 * second + pos]);
      } else {
        q = (v[32 * t + pos] >> (4 * second)) & 15;
        const uint8_t* h = v + 4 * s.block;
        if (s.bits == 5) q |= ((h[8 * t + 4 * second + pos / 8] >> (pos % 8)) & 1) << 4;
        if (s.bits == 6)
          q |= ((h[16 * t + pos % 16] >> (pos >= 16 ? 4 : 0) >> (2 * second)) & 3) << 4;
      }
      float x;
      const int64_t j = k / s.sub;
      switch (type) {
        case Q4_0::TYPE: x = d * static_cast<float>(q - 8); break;
        case Q5_0::TYPE: x = d * static_cast<float>(q - 16); break;
        case Q4_1::TYPE:
        case Q5_1::TYPE:
        case Q8_0::TYPE: x = d * static_cast<float>(q) + m; break;
        case Q6_K::TYPE:
          x = d * static_cast<float>(static_cast<int8_t>(sc[16 + 8 * j + rr])) *
              static_cast<float>(q - 32);
          break;
        default: {  // q4_k, q5_k
          const uint8_t lo = sc[32 + 8 * j + rr], pos6 = static_cast<uint8_t>(8 * j + rr);
          const int mn = lo >> 6 | ((sc[32 + 64 + pos6 % 32] >> (pos6 >= 32 ? 4 : 0)) & 15) << 2;
          x = d * static_cast<float>(lo & 63) * static_cast<float>(q) - m * static_cast<float>(mn);
        }
      }
      out[b * s.block + k] = x;
    }
  }
}

}  // namespace kvserve
