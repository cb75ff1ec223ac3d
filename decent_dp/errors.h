// The core layer's errors: the hierarchy and DECENT_DP_CHECK_ARG live in topology/errors.h.
#pragma once

#include "topology/errors.h"
