// torch_compat.h: where the torch C++ API differs between the torch releases attnstash
// supports (attnstash/_library.py's SUPPORTED_TORCH; CMakeLists.txt refuses any other),
// each difference with the releases it applies to. What F.sdpa does before one backend's
// kernel is that backend's fact and lives in its file (torch_ops/backends/).
#pragma once

#include <torch/version.h>

// Whether the torch this is compiled against is major.minor or newer.
#define ATTNSTASH_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// at::SDPBackend (torch.nn.attention.SDPBackend's values, as at::_fused_sdp_choice returns
// them): <ATen/SDPBackend.h> in every supported release.
#include <ATen/SDPBackend.h>

// C++ standard: torch 2.14's headers require C++20 (CMakeLists.txt chooses it); the code
// here compiles as C++17 and C++20.
