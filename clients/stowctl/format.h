// Human-readable rendering of API messages for stowctl.
#ifndef STOWAGE_CLIENTS_STOWCTL_FORMAT_H_
#define STOWAGE_CLIENTS_STOWCTL_FORMAT_H_

#include <cstdint>
#include <string>

#include "stowage/v1/admin.pb.h"
#include "stowage/v1/generation.pb.h"

namespace stowage {

// "0 B", "512 B", "4.1 MiB", "12.31 GiB"...
std::string HumanBytes(int64_t bytes);
// A two-column table of a reply's image and statistics.
std::string FormatGenerateResponse(const v1::GenerateResponse& response, const std::string& out_path);
// One line per progress event: "denoise  step 3/8  elapsed 0.412 s".
std::string FormatProgress(const v1::Progress& progress);
std::string FormatPipelines(const v1::ListPipelinesResponse& response);
// The device line, one line per component (state, bytes on the device / weights) and, for a
// group-offloaded component, what streams: "groups 12 streamed / 4 resident, 3.20 GiB per forward,
// int8, pinned in place 5.1 GiB".
std::string FormatPlacement(const v1::GetPlacementResponse& response);

}  // namespace stowage

#endif  // STOWAGE_CLIENTS_STOWCTL_FORMAT_H_
