#include "models/core/png_writer.h"

#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace stowage {
namespace {

constexpr int kDefaultMaxThreads = 8;

void AppendU32(std::string& out, uint32_t v) {
  const char bytes[4] = {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
                         static_cast<char>(v)};
  out.append(bytes, 4);
}

// A chunk whose data is already in `data`: length, type, data, CRC of type and data.
void AppendChunk(std::string& out, const char type[4], const std::string& data) {
  AppendU32(out, static_cast<uint32_t>(data.size()));
  out.append(type, 4);
  out.append(data);
  uLong crc = crc32(0L, reinterpret_cast<const Bytef*>(type), 4);
  crc = crc32(crc, reinterpret_cast<const Bytef*>(data.data()), static_cast<uInt>(data.size()));
  AppendU32(out, static_cast<uint32_t>(crc));
}

// One strip, filtered and deflated: its compressed bytes and the checksums the whole needs.
struct Strip {
  std::string deflated;
  uLong adler = 0;  // Of the filtered bytes.
  size_t filtered_bytes = 0;
  uLong crc = 0;    // Of `deflated`.
  bool ok = false;
};

void EncodeStrip(const uint8_t* rgb, size_t row_bytes, int first_row, int rows, bool last, Strip& strip) {
  std::vector<uint8_t> filtered(static_cast<size_t>(rows) * (row_bytes + 1));
  uint8_t* out = filtered.data();
  for (int y = first_row; y < first_row + rows; ++y) {
    const uint8_t* row = rgb + static_cast<size_t>(y) * row_bytes;
    *out++ = 1;  // Sub: each byte less the byte of the pixel to its left.
    const size_t head = std::min<size_t>(3, row_bytes);
    std::memcpy(out, row, head);
    for (size_t i = head; i < row_bytes; ++i) out[i] = static_cast<uint8_t>(row[i] - row[i - 3]);
    out += row_bytes;
  }
  strip.filtered_bytes = filtered.size();
  strip.adler = adler32(adler32(0L, Z_NULL, 0), filtered.data(), static_cast<uInt>(filtered.size()));

  z_stream z{};
  // Raw deflate (no zlib header or trailer of its own: the joined stream has one), level 1.
  if (deflateInit2(&z, 1, Z_DEFLATED, -15, 8, Z_DEFAULT_STRATEGY) != Z_OK) return;
  // The bound covers the data; a sync flush adds an empty stored block (5 bytes) and alignment.
  strip.deflated.resize(deflateBound(&z, static_cast<uLong>(filtered.size())) + 16);
  z.next_in = filtered.data();
  z.avail_in = static_cast<uInt>(filtered.size());
  z.next_out = reinterpret_cast<Bytef*>(strip.deflated.data());
  z.avail_out = static_cast<uInt>(strip.deflated.size());
  const int rc = deflate(&z, last ? Z_FINISH : Z_SYNC_FLUSH);
  const bool done = last ? rc == Z_STREAM_END : rc == Z_OK && z.avail_in == 0 && z.avail_out > 0;
  strip.deflated.resize(strip.deflated.size() - z.avail_out);
  deflateEnd(&z);
  if (!done) return;
  strip.crc = crc32(0L, reinterpret_cast<const Bytef*>(strip.deflated.data()), static_cast<uInt>(strip.deflated.size()));
  strip.ok = true;
}

}  // namespace

int PngWriterThreads(int max_threads) {
  if (max_threads > 0) return max_threads;
  return std::min<int>(kDefaultMaxThreads, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
}

absl::StatusOr<std::string> WriteRgbPng(const uint8_t* rgb, int width, int height, int max_threads) {
  if (rgb == nullptr || width <= 0 || height <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("PNG of ", width, "x", height, ": needs at least one pixel"));
  }
  const size_t row_bytes = static_cast<size_t>(width) * 3;
  // One IDAT chunk holds the stream (its length is 31 bits); zlib's counters are 32 bits.
  if (static_cast<double>(row_bytes + 1) * height > std::numeric_limits<int32_t>::max() / 2) {
    return absl::InvalidArgumentError(absl::StrCat("PNG of ", width, "x", height, " is too large to write"));
  }
  const int strips = (height + kPngStripRows - 1) / kPngStripRows;
  std::vector<Strip> encoded(static_cast<size_t>(strips));
  const int threads = std::min(PngWriterThreads(max_threads), strips);
  std::atomic<int> next{0};
  auto work = [&] {
    for (int s = next.fetch_add(1); s < strips; s = next.fetch_add(1)) {
      const int first = s * kPngStripRows;
      EncodeStrip(rgb, row_bytes, first, std::min(kPngStripRows, height - first), s == strips - 1,
                  encoded[static_cast<size_t>(s)]);
    }
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads; ++t) {
    // A machine out of threads encodes with fewer helpers (this thread takes what they leave).
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;
    }
  }
  work();
  for (std::thread& helper : helpers) helper.join();

  size_t deflated_bytes = 0;
  for (const Strip& strip : encoded) {
    if (!strip.ok) return absl::InternalError("PNG encoding failed: zlib could not deflate a strip");
    deflated_bytes += strip.deflated.size();
  }

  std::string png;
  png.reserve(deflated_bytes + 128);
  png.append("\x89PNG\r\n\x1a\n", 8);
  std::string ihdr;
  AppendU32(ihdr, static_cast<uint32_t>(width));
  AppendU32(ihdr, static_cast<uint32_t>(height));
  ihdr.append({8, 2, 0, 0, 0});  // 8 bits, RGB, deflate, adaptive filtering, not interlaced.
  AppendChunk(png, "IHDR", ihdr);

  // IDAT: the zlib header (deflate, 32 KiB window, "fastest"), the strips, the combined Adler-32.
  // Its CRC is combined from the strips' CRCs instead of reading the bytes again.
  const char header[2] = {0x78, 0x01};
  std::string trailer;
  uLong adler = encoded[0].adler;
  for (size_t s = 1; s < encoded.size(); ++s) {
    adler = adler32_combine(adler, encoded[s].adler, static_cast<z_off_t>(encoded[s].filtered_bytes));
  }
  AppendU32(trailer, static_cast<uint32_t>(adler));
  AppendU32(png, static_cast<uint32_t>(2 + deflated_bytes + 4));
  png.append("IDAT", 4);
  uLong crc = crc32(0L, reinterpret_cast<const Bytef*>("IDAT"), 4);
  png.append(header, 2);
  crc = crc32(crc, reinterpret_cast<const Bytef*>(header), 2);
  for (const Strip& strip : encoded) {
    png.append(strip.deflated);
    crc = crc32_combine(crc, strip.crc, static_cast<z_off_t>(strip.deflated.size()));
  }
  png.append(trailer);
  crc = crc32(crc, reinterpret_cast<const Bytef*>(trailer.data()), 4);
  AppendU32(png, static_cast<uint32_t>(crc));
  AppendChunk(png, "IEND", "");
  return png;
}

}  // namespace stowage
