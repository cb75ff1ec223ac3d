# Install rules and the exported package: find_package(DecentDP) gives decent_dp::decent_dp.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(DECENT_DP_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/DecentDP)

install(TARGETS decent_dp decent_dp_base decent_dp_core decent_dp_optim decent_dp_topology
  EXPORT DecentDPTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# One include root: include/decent_dp/*.h, include/decent_dp/{optim,topology}/*.h.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/decent_dp/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/decent_dp
  FILES_MATCHING PATTERN "*.h" PATTERN "detail" EXCLUDE)
foreach(_dir topology optim)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${_dir}/
    DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/decent_dp/${_dir} FILES_MATCHING PATTERN "*.h")
endforeach()
install(FILES ${PROJECT_BINARY_DIR}/include/decent_dp/config.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/decent_dp)
# NCCL is a link dependency of the static core when the backend is built: consumers find it
# with the same module.
if(DECENT_DP_HAVE_NCCL)
  install(FILES ${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake DESTINATION ${DECENT_DP_CMAKE_DIR})
endif()
install(EXPORT DecentDPTargets NAMESPACE decent_dp:: DESTINATION ${DECENT_DP_CMAKE_DIR})

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/DecentDPConfig.cmake.in
  ${PROJECT_BINARY_DIR}/DecentDPConfig.cmake INSTALL_DESTINATION ${DECENT_DP_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/DecentDPConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/DecentDPConfig.cmake
              ${PROJECT_BINARY_DIR}/DecentDPConfigVersion.cmake
        DESTINATION ${DECENT_DP_CMAKE_DIR})
