# Installs the build tree into a scratch prefix, then configures, builds and runs a tiny
# project that uses it only through find_package(DecentDP), as a downstream user would.
file(REMOVE_RECURSE "${WORK_DIR}")
execute_process(COMMAND ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix"
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed (${rc})")
endif()
execute_process(
  COMMAND ${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/downstream/project" -B "${WORK_DIR}/build"
          -G "${GENERATOR}" "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix;${TORCH_PREFIX}"
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the downstream project failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build "${WORK_DIR}/build" -j 2 RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the downstream project failed (${rc})")
endif()
execute_process(
  COMMAND ${MPIEXEC} -n 2 --oversubscribe --bind-to none "${WORK_DIR}/build/consumer"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 0 OR NOT out MATCHES "consumer ok: mean 1.5")
  message(FATAL_ERROR "the downstream program failed (${rc})")
endif()
