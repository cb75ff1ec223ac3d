// Catch2 for test files that use LibTorch. c10's logging header defines a CHECK macro of its
// own (it aborts and is not counted by Catch); include it first, drop its CHECK, then let
// Catch define the test macros. Include this instead of <catch2/catch.hpp>, before any
// LibTorch header.
#pragma once

#include <c10/util/Logging.h>
#undef CHECK

#include <catch2/catch.hpp>
