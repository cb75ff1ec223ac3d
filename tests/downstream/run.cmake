# Installs the build tree into a scratch prefix, moves the prefix elsewhere (the package must
# be relocatable), then configures, builds and runs a small trainer that uses it only through
# find_package(DecentDP), as a downstream user would. That trainer is the README's usage
# snippet, checked here word for word.
file(READ "${SOURCE_DIR}/README.md" readme)
file(READ "${SOURCE_DIR}/tests/downstream/project/main.cpp" program)
string(FIND "${readme}" "## Use" use_at)
string(SUBSTRING "${readme}" ${use_at} -1 use_section)
string(FIND "${use_section}" "```cpp\n" start)
math(EXPR start "${start} + 7")
string(SUBSTRING "${use_section}" ${start} -1 rest)
string(FIND "${rest}" "```" stop)
string(SUBSTRING "${rest}" 0 ${stop} snippet)
if(NOT snippet STREQUAL program)
  message(FATAL_ERROR "README.md's usage snippet differs from tests/downstream/project/main.cpp")
endif()

file(REMOVE_RECURSE "${WORK_DIR}")
execute_process(COMMAND ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/staging"
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed (${rc})")
endif()
file(RENAME "${WORK_DIR}/staging" "${WORK_DIR}/moved")
file(GLOB_RECURSE exported "${WORK_DIR}/moved/*.cmake")
foreach(f ${exported})
  file(READ "${f}" text)
  string(FIND "${text}" "${WORK_DIR}/staging" at)
  string(FIND "${text}" "${BUILD_DIR}" at_build)
  string(FIND "${text}" "${TORCH_PREFIX}" at_torch)
  string(FIND "${text}" "site-packages" at_wheel)  # LibTorch's library folder
  if(NOT at EQUAL -1 OR NOT at_build EQUAL -1 OR NOT at_torch EQUAL -1 OR NOT at_wheel EQUAL -1)
    message(FATAL_ERROR "${f} names a path of the build machine (install prefix, build folder "
                        "or LibTorch); the package must be relocatable")
  endif()
endforeach()
execute_process(
  COMMAND ${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/downstream/project" -B "${WORK_DIR}/build"
          -G "${GENERATOR}" "-DCMAKE_PREFIX_PATH=${WORK_DIR}/moved;${TORCH_PREFIX}"
  RESULT_VARIABLE rc OUTPUT_VARIABLE configure_out)
message("${configure_out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the downstream project failed (${rc})")
endif()
# The package says whether the NCCL backend is in, as the build's config.h does.
file(READ "${WORK_DIR}/moved/include/decent_dp/config.h" config_h)
string(REGEX MATCH "#define DECENT_DP_HAVE_NCCL ([01])" _ "${config_h}")
set(have_nccl "${CMAKE_MATCH_1}")
if(have_nccl STREQUAL "1")
  set(want "DecentDP_WITH_NCCL=ON")
else()
  set(want "DecentDP_WITH_NCCL=OFF")
endif()
if(NOT configure_out MATCHES "${want}")
  message(FATAL_ERROR "the package should report ${want} (config.h: DECENT_DP_HAVE_NCCL ${have_nccl})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build "${WORK_DIR}/build" -j 2 RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the downstream project failed (${rc})")
endif()
execute_process(
  COMMAND ${MPIEXEC} -n 2 --oversubscribe --bind-to none "${WORK_DIR}/build/consumer"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 0 OR NOT out MATCHES "consumer ok: 2 updates")
  message(FATAL_ERROR "the downstream program failed (${rc})")
endif()
