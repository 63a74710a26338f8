// libpng at zlib level 1 with the Sub filter: what EncodePng wrote before the parallel writer
// (models/core/png_writer.h), kept as the reference its benchmark and test compare with.
#ifndef STOWAGE_BENCH_LIBPNG_LEVEL1_H_
#define STOWAGE_BENCH_LIBPNG_LEVEL1_H_

#include <cstdint>
#include <string>
#include <vector>

namespace stowage {

// `rgb`: height rows of width × 3 bytes.
std::string LibpngLevel1(const std::vector<uint8_t>& rgb, int width, int height);

}  // namespace stowage

#endif  // STOWAGE_BENCH_LIBPNG_LEVEL1_H_
