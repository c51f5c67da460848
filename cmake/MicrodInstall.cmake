# What `cmake --install` puts in the prefix besides the targets themselves
# (those install rules sit next to them in client/ and daemon/): the CMake
# package (find_package(microd) -> microd::client, microd::client_static) and
# the pkg-config file microd.pc. Both are relocatable: they find the prefix
# from their own location, so `cmake --install build --prefix DIR` works for
# any DIR chosen at install time.
include(CMakePackageConfigHelpers)

set(MICROD_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/microd)
install(EXPORT microdTargets NAMESPACE microd:: FILE microdTargets.cmake
  DESTINATION ${MICROD_CMAKE_DIR} COMPONENT client)
configure_package_config_file(cmake/microdConfig.cmake.in
  ${CMAKE_BINARY_DIR}/generated/microdConfig.cmake INSTALL_DESTINATION ${MICROD_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_BINARY_DIR}/generated/microdConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/generated/microdConfig.cmake
  ${CMAKE_BINARY_DIR}/generated/microdConfigVersion.cmake
  DESTINATION ${MICROD_CMAKE_DIR} COMPONENT client)

# microd.pc: prefix relative to the .pc file's own directory (${pcfiledir}).
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}" OR IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  message(FATAL_ERROR "microd: CMAKE_INSTALL_LIBDIR and CMAKE_INSTALL_INCLUDEDIR must be "
                      "relative to the prefix (the package files are relocatable)")
endif()
file(RELATIVE_PATH MICROD_PC_TO_PREFIX /prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig /prefix)
string(REGEX REPLACE "/$" "" MICROD_PC_TO_PREFIX "${MICROD_PC_TO_PREFIX}")
configure_file(cmake/microd.pc.in ${CMAKE_BINARY_DIR}/generated/microd.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/generated/microd.pc
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT client)
