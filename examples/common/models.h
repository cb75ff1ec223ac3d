// Models of the examples and benchmarks, all as torch::nn::Sequential so either wrapper can
// hold them:
//   resnet18, resnet34, resnet50  the ImageNet ResNets in CIFAR form (3x3 stem, stride 1, no
//                                 max-pool; projection shortcuts): 11,173,962 / 21,282,122 /
//                                 23,520,842 parameters at 10 classes and 3 input channels
//   resnet20, resnet56            He et al.'s CIFAR family (16/32/64 channels, 3 stages of
//                                 3 or 9 basic blocks, parameter-free shortcuts that subsample
//                                 and zero-pad channels): 269,722 / 853,018 parameters
//   cnn                           two 3x3 convolutions with max-pooling and two linear layers
//   mlp                           two hidden layers of 256 units
// Every model takes `in_channels` (1 for grey images); the cnn and the mlp also need the
// image side, the ResNets pool globally and take any side of 8 pixels or more.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <string>
#include <vector>

namespace decent_dp {
namespace examples {

// The names make_model() accepts.
const std::vector<std::string>& model_names();

// Builds model `name` with parameters drawn from LibTorch's default generator (seed it first
// for the same model on every run). Throws std::invalid_argument naming the argument.
torch::nn::Sequential make_model(const std::string& name, int64_t in_channels = 3,
                                 int64_t num_classes = 10, int64_t image_size = 32);

// Number of parameter elements of `module`.
int64_t parameter_count(const torch::nn::Module& module);

}  // namespace examples
}  // namespace decent_dp
