// Deterministic random weights for built-in and benchmark models.
#ifndef STOWAGE_MODELS_CORE_WEIGHT_INIT_H_
#define STOWAGE_MODELS_CORE_WEIGHT_INIT_H_

#include <cstdint>

#include "offload/module.h"

namespace stowage {

// Fills every defined tensor of `root` in place. Each tensor draws from its own generator, seeded
// by `seed` and the tensor's dotted path, so a tensor's values do not depend on which other
// tensors exist or in what order they were built. Matrices and kernels: N(0, 1/fan_in); embeddings
// N(0, 1); norm scales 1 + N(0, 0.1²); biases N(0, 0.02²). Tensors of more than 2^20 elements tile
// 2^20 drawn values, so billion-parameter benchmark models fill at memory speed.
void InitializeRandomWeights(Module& root, uint64_t seed);

}  // namespace stowage

#endif  // STOWAGE_MODELS_CORE_WEIGHT_INIT_H_
