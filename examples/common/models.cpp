#include "examples/common/models.h"

#include <torch/torch.h>

#include <algorithm>
#include <stdexcept>

namespace decent_dp {
namespace examples {
namespace {

namespace nn = torch::nn;

nn::Conv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride = 1) {
  return nn::Conv2d(
      nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false));
}

// Shortcut of a residual block whose shape changes.
enum class Shortcut {
  kProjection,  // 1x1 convolution with stride + batch norm (the ImageNet ResNets)
  kPadding,     // subsample by the stride, zero-pad the new channels (He et al.'s option A)
};

// Two 3x3 convolutions (ResNet-18/34, ResNet-20/56).
struct BasicBlockImpl : nn::Module {
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride, Shortcut kind)
      : conv1(register_module("conv1", conv(in, out, 3, stride))),
        bn1(register_module("bn1", nn::BatchNorm2d(out))),
        conv2(register_module("conv2", conv(out, out, 3))),
        bn2(register_module("bn2", nn::BatchNorm2d(out))),
        stride_(stride),
        pad_(0) {
    if (stride != 1 || in != out) {
      if (kind == Shortcut::kProjection) {
        shortcut = register_module("shortcut",
                                   nn::Sequential(conv(in, out, 1, stride), nn::BatchNorm2d(out)));
      } else {
        pad_ = out - in;
      }
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = torch::relu(bn1(conv1(x)));
    y = bn2(conv2(y));
    return torch::relu(y + skip(x));
  }
  torch::Tensor skip(const torch::Tensor& x) {
    if (shortcut)
      return shortcut->forward(x);
    if (stride_ == 1 && pad_ == 0)
      return x;
    auto s = x.slice(2, 0, x.size(2), stride_).slice(3, 0, x.size(3), stride_);
    return torch::constant_pad_nd(s, {0, 0, 0, 0, pad_ / 2, pad_ - pad_ / 2});
  }
  nn::Conv2d conv1;
  nn::BatchNorm2d bn1;
  nn::Conv2d conv2;
  nn::BatchNorm2d bn2;
  nn::Sequential shortcut{nullptr};
  int64_t stride_;
  int64_t pad_;
};
TORCH_MODULE(BasicBlock);

// 1x1 -> 3x3 -> 1x1 with 4x expansion (ResNet-50).
struct BottleneckImpl : nn::Module {
  static constexpr int64_t kExpansion = 4;
  BottleneckImpl(int64_t in, int64_t planes, int64_t stride)
      : conv1(register_module("conv1", conv(in, planes, 1))),
        bn1(register_module("bn1", nn::BatchNorm2d(planes))),
        conv2(register_module("conv2", conv(planes, planes, 3, stride))),
        bn2(register_module("bn2", nn::BatchNorm2d(planes))),
        conv3(register_module("conv3", conv(planes, planes * kExpansion, 1))),
        bn3(register_module("bn3", nn::BatchNorm2d(planes * kExpansion))) {
    if (stride != 1 || in != planes * kExpansion) {
      shortcut =
          register_module("shortcut", nn::Sequential(conv(in, planes * kExpansion, 1, stride),
                                                     nn::BatchNorm2d(planes * kExpansion)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = torch::relu(bn1(conv1(x)));
    y = torch::relu(bn2(conv2(y)));
    y = bn3(conv3(y));
    return torch::relu(y + (shortcut ? shortcut->forward(x) : x));
  }
  nn::Conv2d conv1;
  nn::BatchNorm2d bn1;
  nn::Conv2d conv2;
  nn::BatchNorm2d bn2;
  nn::Conv2d conv3;
  nn::BatchNorm2d bn3;
  nn::Sequential shortcut{nullptr};
};
TORCH_MODULE(Bottleneck);

void add_head(nn::Sequential& s, int64_t features, int64_t num_classes) {
  s->push_back(nn::AdaptiveAvgPool2d(1));
  s->push_back(nn::Flatten());
  s->push_back(nn::Linear(features, num_classes));
}

// The ImageNet ResNets with the CIFAR stem: 64/128/256/512 channels in four stages.
nn::Sequential imagenet_resnet(const std::vector<int>& blocks, bool bottleneck, int64_t in_channels,
                               int64_t num_classes) {
  nn::Sequential s;
  s->push_back(conv(in_channels, 64, 3));
  s->push_back(nn::BatchNorm2d(64));
  s->push_back(nn::ReLU());
  int64_t in = 64;
  const int64_t widths[] = {64, 128, 256, 512};
  for (int stage = 0; stage < 4; ++stage) {
    for (int b = 0; b < blocks[stage]; ++b) {
      const int64_t stride = stage > 0 && b == 0 ? 2 : 1;
      if (bottleneck) {
        s->push_back(Bottleneck(in, widths[stage], stride));
        in = widths[stage] * BottleneckImpl::kExpansion;
      } else {
        s->push_back(BasicBlock(in, widths[stage], stride, Shortcut::kProjection));
        in = widths[stage];
      }
    }
  }
  add_head(s, in, num_classes);
  return s;
}

// He et al.'s CIFAR ResNets: depth 6n + 2, 16/32/64 channels in three stages of n blocks.
nn::Sequential cifar_resnet(int n, int64_t in_channels, int64_t num_classes) {
  nn::Sequential s;
  s->push_back(conv(in_channels, 16, 3));
  s->push_back(nn::BatchNorm2d(16));
  s->push_back(nn::ReLU());
  int64_t in = 16;
  const int64_t widths[] = {16, 32, 64};
  for (int stage = 0; stage < 3; ++stage) {
    for (int b = 0; b < n; ++b) {
      const int64_t stride = stage > 0 && b == 0 ? 2 : 1;
      s->push_back(BasicBlock(in, widths[stage], stride, Shortcut::kPadding));
      in = widths[stage];
    }
  }
  add_head(s, in, num_classes);
  return s;
}

nn::Sequential cnn(int64_t in_channels, int64_t num_classes, int64_t image_size) {
  const int64_t side = image_size / 4;
  return nn::Sequential(conv(in_channels, 32, 3), nn::ReLU(), nn::MaxPool2d(2), conv(32, 64, 3),
                        nn::ReLU(), nn::MaxPool2d(2), nn::Flatten(),
                        nn::Linear(64 * side * side, 128), nn::ReLU(), nn::Dropout(0.25),
                        nn::Linear(128, num_classes));
}

nn::Sequential mlp(int64_t in_channels, int64_t num_classes, int64_t image_size) {
  return nn::Sequential(nn::Flatten(), nn::Linear(in_channels * image_size * image_size, 256),
                        nn::ReLU(), nn::Linear(256, 256), nn::ReLU(), nn::Linear(256, num_classes));
}

}  // namespace

const std::vector<std::string>& model_names() {
  static const std::vector<std::string> names = {"resnet18", "resnet34", "resnet50", "resnet20",
                                                 "resnet56", "cnn",      "mlp"};
  return names;
}

torch::nn::Sequential make_model(const std::string& name, int64_t in_channels, int64_t num_classes,
                                 int64_t image_size) {
  const auto& names = model_names();
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    std::string list;
    for (const auto& n : names)
      list += (list.empty() ? "" : ", ") + n;
    throw std::invalid_argument("model: unknown model '" + name + "', expected one of " + list);
  }
  if (in_channels < 1)
    throw std::invalid_argument("model: in_channels must be >= 1, got " +
                                std::to_string(in_channels));
  if (num_classes < 2)
    throw std::invalid_argument("model: num_classes must be >= 2, got " +
                                std::to_string(num_classes));
  const int64_t min_side = name == "cnn" ? 4 : (name == "mlp" ? 1 : 8);
  if (image_size < min_side)
    throw std::invalid_argument("model: image_size of " + name + " must be >= " +
                                std::to_string(min_side) + ", got " + std::to_string(image_size));
  if (name == "resnet18")
    return imagenet_resnet({2, 2, 2, 2}, false, in_channels, num_classes);
  if (name == "resnet34")
    return imagenet_resnet({3, 4, 6, 3}, false, in_channels, num_classes);
  if (name == "resnet50")
    return imagenet_resnet({3, 4, 6, 3}, true, in_channels, num_classes);
  if (name == "resnet20")
    return cifar_resnet(3, in_channels, num_classes);
  if (name == "resnet56")
    return cifar_resnet(9, in_channels, num_classes);
  if (name == "cnn")
    return cnn(in_channels, num_classes, image_size);
  return mlp(in_channels, num_classes, image_size);
}

int64_t parameter_count(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters())
    n += p.numel();
  return n;
}

}  // namespace examples
}  // namespace decent_dp
